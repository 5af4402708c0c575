"""``moeckpt.dcp``: a ``torch.distributed.checkpoint`` storage backend for the moeckpt format.

``dcp.save(state_dict, storage_writer=moeckpt.dcp.StorageWriter(url))`` writes a moeckpt checkpoint (checksummed,
JSON index, no pickle on disk, safetensors or zarr, local disk or S3); ``dcp.load(state_dict,
storage_reader=moeckpt.dcp.StorageReader(url))`` reads any moeckpt checkpoint, the bundled trainer's included.
"""

from moeckpt.library.dcp_storage import StorageReader, StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
