"""The compression settings a checkpoint may be written with (``--compress``, ``moeckpt.save(compress=...)``).

One name per setting, the one list the CLI, the library and the trainer offer. A setting is what the writer
asked for; what each array actually stores is in its own metadata (the zarr backend records standard zarr v3
codecs in every ``zarr.json``, so a reader never needs the setting to decode). ``none`` stores the bytes raw, as
every checkpoint before format version 4 did; any other setting is written as index format version 4 (see
``docs/format.md``). Only backends that list a setting in their ``compressions`` take it (the zarr backend).
"""

from __future__ import annotations

from .errors import CheckpointIndexError

#: the bytes as they are (the default; the checkpoint's bytes are those of every earlier moeckpt).
NONE = "none"
#: blosc (zarr v3's ``blosc`` codec) with zstd at level 1, byte shuffle at the element size, 1 MiB blocks
#: (docs/zarr.md; the measurement on a trained checkpoint and its entropy bound are issue 32's items 4 and 5).
BLOSC_ZSTD = "blosc-zstd"

#: every setting, with the line ``--help`` shows for it.
COMPRESSIONS: dict[str, str] = {
    NONE: "store the bytes raw",
    BLOSC_ZSTD: "lossless blosc + zstd with byte shuffle (zarr only; any zarr v3 reader decodes it)",
}

#: the one line of help every ``--compress`` shows (the CLI's commands and ``moeckpt train``'s config).
COMPRESS_HELP = "lossless compression of the data written (blosc-zstd: zarr only; see docs/zarr.md)"


def compress_names() -> tuple[str, ...]:
    """The setting names, ``none`` first."""
    return tuple(COMPRESSIONS)


def check_compress(value: object, where: str = "compress") -> str:
    """``value`` if it names a setting, else :class:`CheckpointIndexError` naming the known ones."""
    if not isinstance(value, str) or value not in COMPRESSIONS:
        raise CheckpointIndexError(f"{where}: unknown compression {value!r}; choose one of: {', '.join(COMPRESSIONS)}")
    return value
