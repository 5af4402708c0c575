"""Values shared by every backend: a piece to write, a reference to a stored piece, block checksums."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from . import dtypes
from .box import Box
from .checksum import checksum
from .errors import ChecksumMismatchError
from .slices import SliceGeometry, geometry, verify_rows

if TYPE_CHECKING:
    import torch

#: Pieces are checksummed in blocks of this many bytes, so a reader that needs part of a piece (a new ZeRO split
#: reading a row range of an old one) can verify exactly the blocks it reads instead of the whole piece.
CHECKSUM_BLOCK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Piece:
    """A box of a logical tensor with its data, as one writer holds it."""

    tensor: str
    box: Box
    data: torch.Tensor

    def __post_init__(self) -> None:
        if tuple(self.data.shape) != self.box.shape:
            raise ValueError(
                f"piece of {self.tensor!r}: data shape {tuple(self.data.shape)} differs from box shape {self.box.shape}"
            )


@dataclass(frozen=True)
class PieceRef:
    """Where a stored piece lives: which file, which bytes, and the checksums of its blocks."""

    tensor: str
    box: Box
    dtype: str
    file: str
    #: absolute byte offset of the piece in ``file``, and its length.
    start: int
    nbytes: int
    checksums: tuple[str, ...]
    block_bytes: int = CHECKSUM_BLOCK_BYTES
    #: zarr only: the inner chunk shape of the shard object ``file`` (each inner chunk carries its own crc32c, so
    #: ``checksums`` is empty); ``None`` when the piece is one plain chunk object (data + crc32c) or not zarr.
    chunks: tuple[int, ...] | None = None
    #: zarr only: the shape the object ``file`` stores; a cell at the array's end is stored padded to the full
    #: chunk shape (zarr's rule for edge chunks), so it can be larger than ``box.shape``. ``None``: ``box.shape``.
    stored_shape: tuple[int, ...] | None = None
    #: zarr only: the compression setting of the object's chunks (:mod:`~moeckpt.formats.compression`); with any
    #: but ``"none"`` a read decodes whole (inner) chunks, whatever rows it wants.
    compress: str = "none"
    #: safetensors, version 5: the piece's checksum slices along dimension ``slice_dim`` (their sizes, in order;
    #: :mod:`~moeckpt.formats.slices`); empty: blocks of ``block_bytes`` along the flat bytes (version 1).
    slice_dim: int = 0
    slices: tuple[int, ...] = ()

    @cached_property
    def geometry(self) -> SliceGeometry | None:
        """The slice geometry of a sliced piece, else None."""
        if not self.slices:
            return None
        return geometry(self.box.shape, dtypes.itemsize(self.dtype), self.slice_dim, self.slices, self.block_bytes)

    @property
    def unit_bytes(self) -> int:
        """Bytes of a verification unit: a checksum block, or for a sliced piece a group of whole rows (every
        slice's block over the same rows). Reads of whole rows are widened to these, from multiples of them."""
        g = self.geometry
        return self.block_bytes if g is None else g.unit_bytes


def block_span(ref: PieceRef, lo: int, hi: int) -> tuple[int, int, int, int, int]:
    """Rows ``[lo, hi)`` of a stored piece as bytes ``[a, b)`` of its data, and the whole checksum blocks around
    them: the first block's number and bytes ``[read_lo, read_hi)`` (what a verified read fetches)."""
    row = ref.nbytes // ref.box.shape[0] if ref.box.shape[0] else 0
    a, b = lo * row, hi * row
    block = ref.unit_bytes
    b0 = a // block
    return a, b, b0, b0 * block, min(-(-b // block) * block if b else block, ref.nbytes)


def fetched_bytes(ref: PieceRef, lo: int, hi: int) -> int:
    """Bytes a verified read of rows ``[lo, hi)`` fetches: the whole checksum blocks around them (how every
    backend verifies reads), or exactly the rows for a piece without blocks (rows a function produces)."""
    if not ref.box.ndim or not ref.box.shape[0]:
        return ref.nbytes
    if not ref.block_bytes:
        return (hi - lo) * (ref.nbytes // ref.box.shape[0])  # rows a function produces: no blocks
    _, _, _, read_lo, read_hi = block_span(ref, lo, hi)
    return read_hi - read_lo


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor without a copy when it is contiguous (any dtype, bf16 included)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # Flatten before the dtype view: viewing a 0-d tensor as another element size is refused by torch.
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def block_checksums(data: memoryview | bytes | bytearray, block_bytes: int = CHECKSUM_BLOCK_BYTES) -> list[str]:
    mv = memoryview(data).cast("B")
    if len(mv) == 0:
        return [checksum(b"")]
    return [checksum(mv[i : i + block_bytes]) for i in range(0, len(mv), block_bytes)]


def verify_blocks(data: bytes | bytearray | memoryview, first_block: int, ref: PieceRef, where: str) -> None:
    """Check the blocks ``first_block, first_block+1, ...`` of ``ref`` that ``data`` holds, whole (for a sliced
    piece: its row groups, every slice)."""
    mv = memoryview(data).cast("B")
    if ref.geometry is not None:
        verify_rows(mv, first_block, ref.geometry, ref.checksums, where, f"{ref.tensor!r} box {ref.box.to_json()}")
        return
    for i, off in enumerate(range(0, max(len(mv), 1), ref.block_bytes)):
        check_block(ref, first_block + i, checksum(mv[off : off + ref.block_bytes]), where)


def check_block(ref: PieceRef, block: int, got: str, where: str) -> None:
    """Refuse checksum ``got`` of block ``block`` of ``ref`` unless it is the recorded one (however it was
    computed: on the host, or on a device from the block's accumulators)."""
    if block >= len(ref.checksums):
        raise ChecksumMismatchError(f"{where}: piece of {ref.tensor!r} holds more blocks than recorded")
    if got != ref.checksums[block]:
        raise ChecksumMismatchError(
            f"{where}: checksum mismatch in tensor {ref.tensor!r} box {ref.box.to_json()} block {block} "
            f"(expected {ref.checksums[block]}, got {got}); the file is corrupt"
        )
