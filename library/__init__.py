"""The library API (``moeckpt.save`` / ``load`` / ``async_save``, ``Checkpointer``, ``moeckpt.dcp``): a client of
the resharding engine (:mod:`moeckpt.reshard`) and the formats, beside the trainer; neither of them uses it.

State dicts of DTensors and tensors are described (:mod:`.state_dict`), planned into pieces and saved through the
engine's save protocol (:mod:`.state_save`, :mod:`.save_load`), loaded in place through its box loads
(:mod:`.state_load`); :mod:`.checkpointer` keeps a run directory of them; :mod:`.dcp_storage` is the
``torch.distributed.checkpoint`` storage backend.
"""
