"""Saving logical tensors, given as whole tensors, as a checkpoint in any layout (``init``, imports, tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.checkpoint import save_pieces
from moeckpt.formats.compression import NONE
from moeckpt.formats.index import Index, TensorEntry
from moeckpt.formats.pieces import Piece

from .layout import Layout
from .placement import placements
from .tensors import check_layout


def save_full_tensors(
    location: str,
    *,
    tensors: dict[str, TensorEntry],
    layout: Layout,
    values: Callable[[TensorEntry], torch.Tensor],
    model: dict[str, Any],
    backend: str = "safetensors",
    compress: str = NONE,
    step: int = 0,
    train_state: dict[str, Any] | None = None,
    overwrite: bool = False,
    workers: int = 4,
    on_written: Callable[[int], None] | None = None,
) -> Index:
    """Split every tensor (``values(entry)`` returns it whole) into the layout's pieces and commit a checkpoint;
    ``on_written`` gets the bytes of each writer's file once written (progress bars); ``compress``: the compression
    setting (:mod:`moeckpt.formats.compression`) of a backend that takes one."""
    check_layout(tensors, layout)
    by_writer: dict[int, list[Piece]] = {r: [] for r in range(layout.world)}
    for entry in tensors.values():
        full = values(entry)
        if tuple(full.shape) != entry.shape or dtypes.from_torch(full.dtype) != entry.dtype:
            raise ValueError(
                f"{entry.name}: value has shape {tuple(full.shape)} {full.dtype}, expected {entry.shape} {entry.dtype}"
            )
        for p in placements(entry, layout):
            by_writer[p.writer].append(Piece(entry.name, p.box, full[p.box.slices()]))
    index = Index(
        backend=backend,
        compress=compress,
        step=step,
        layout=layout.to_json(),
        model=model,
        tensors=tensors,
        files={},
        train_state=train_state or {},
    )
    return save_pieces(location, index, by_writer, overwrite=overwrite, workers=workers, on_written=on_written)
