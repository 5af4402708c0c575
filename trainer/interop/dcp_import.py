"""Import a torch DCP checkpoint (torchtitan, Megatron-Core ``torch_dist``, any ``dcp.save``) as a moeckpt
checkpoint in any layout and format.

:class:`DcpImport` opens the DCP directory without running its pickles, applies a mapping (``none``,
``torchtitan``, ``megatron``) and checks the result before anything is written; :meth:`DcpImport.write` then
streams the DCP chunks into the new checkpoint through the offline executor (bounded memory, parallel reads,
each chunk read once) and commits it, or leaves nothing behind on failure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from moeckpt.formats.backend import get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.compression import NONE
from moeckpt.formats.dcp import DcpCheckpoint
from moeckpt.formats.index import STORED_SHARDING, Index
from moeckpt.reshard.dcp_source import kept_chunks, write_from_dcp
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.runtime import paused_gc
from moeckpt.reshard.state_dict_checkpoints import sharded_over_writers
from moeckpt.reshard.tensors import check_layout

from ..models import ModelSpec
from . import megatron, torchtitan
from .common import Mapped, MappingError
from .unmapped import GENERIC_ARCH, map_generic

MAPPINGS = ("none", "torchtitan", "megatron")


def apply_mapping(dcp: DcpCheckpoint, mapping: str, model: ModelSpec | None = None) -> Mapped:
    """The checkpoint ``dcp`` seen through ``mapping``; ``model`` (``--model``) fills what shapes do not tell."""
    if mapping == "none":
        if model is not None:
            raise MappingError(
                "--model applies to a named mapping (torchtitan, megatron); --mapping none keeps the checkpoint generic"
            )
        mapped = map_generic(dcp)
        hint = next(
            (m for m, mod in (("torchtitan", torchtitan), ("megatron", megatron)) if mod.looks_like(dcp.tensors)), None
        )
        if hint:
            mapped.notes.append(
                f"the names look like {hint}'s: --mapping {hint} converts them into a model plan "
                "(exportable to Hugging Face)"
            )
        return mapped
    if mapping == "torchtitan":
        return torchtitan.map_torchtitan(dcp, model)
    if mapping == "megatron":
        return megatron.map_megatron(dcp, model)
    raise MappingError(f"unknown mapping {mapping!r}; choose one of: {', '.join(MAPPINGS)}")


class DcpImport:
    """A checked DCP checkpoint and the moeckpt checkpoint it becomes (``index``, committed by :meth:`write`)."""

    def __init__(
        self,
        location: str,
        *,
        layout: Layout | None,
        mapping: str = "none",
        backend: str = "safetensors",
        model: ModelSpec | None = None,
        workers: int = 8,
        compress: str = NONE,
    ):
        """``layout`` ``None`` keeps a generic (``--mapping none``) checkpoint's DCP chunks as they are (each in the
        file of the rank that wrote it); a layout of ``dp`` writers splits every tensor along dim 0 over them."""
        get_backend(backend, compress=compress)  # a format that cannot compress is refused before any read
        with paused_gc():  # the metadata's unpickling and the mapping make many objects: see paused_gc
            self._open(location, layout, mapping, backend, model, workers, compress)

    def _open(
        self,
        location: str,
        layout: Layout | None,
        mapping: str,
        backend: str,
        model: ModelSpec | None,
        workers: int,
        compress: str,
    ) -> None:
        self.dcp = DcpCheckpoint(location, workers=workers)
        self.mapped = apply_mapping(self.dcp, mapping, model)
        generic = self.mapped.model["arch"] == GENERIC_ARCH
        self.targets: dict[str, list[tuple[Box, int]]] | None = None
        train_state = {
            "step": 0,
            **self.mapped.train_state,
            "imported_from": self.dcp.location,
            "imported_mapping": mapping,
        }
        step = train_state["step"] if type(train_state["step"]) is int and train_state["step"] >= 0 else 0
        index = Index(
            backend=backend,
            compress=compress,
            step=step,
            layout=Layout().to_json(),
            model=self.mapped.model,
            tensors=self.mapped.tensors,
            files={},
            train_state=train_state,
        )
        if generic and layout is None:
            self.targets = kept_chunks(self.dcp, list(index.tensors))
            writers = 1 + max((w for pieces in self.targets.values() for _, w in pieces), default=0)
            layout = Layout(dp=writers)
            index = replace(
                index,
                layout={},
                tensors={n: replace(e, sharding=dict(STORED_SHARDING)) for n, e in index.tensors.items()},
            )
        elif generic and layout is not None:
            index = sharded_over_writers(index, layout)
        layout = layout or Layout()
        if not generic:
            ModelSpec.from_json(self.mapped.model).check_layout(layout.tp, layout.ep)
        self.layout = layout
        self.index = index
        check_layout(self.index.tensors, layout)

    @property
    def notes(self) -> list[str]:
        return self.mapped.notes

    def write(
        self,
        dst: str,
        *,
        overwrite: bool = False,
        workers: int | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> tuple[Index, int]:
        """Write and commit the checkpoint at ``dst``; returns its index and the bytes read from the DCP files."""
        try:
            with paused_gc():  # listing the DCP chunks and mapping them to pieces: see paused_gc
                return write_from_dcp(
                    self.dcp,
                    self.index,
                    self.mapped.slots,
                    dst,
                    self.layout,
                    workers=workers,
                    overwrite=overwrite,
                    on_bytes=on_bytes,
                    targets=self.targets,
                )
        finally:
            self.dcp.close()


def import_dcp(
    location: str,
    dst: str,
    *,
    layout: Layout | None = None,
    mapping: str = "none",
    backend: str = "safetensors",
    model: ModelSpec | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
    compress: str = NONE,
) -> Index:
    """Convert the DCP checkpoint at ``location`` into a moeckpt checkpoint at ``dst`` (see :class:`DcpImport`)."""
    job = DcpImport(location, layout=layout, mapping=mapping, backend=backend, model=model, compress=compress)
    index, _ = job.write(dst, overwrite=overwrite, workers=workers, on_bytes=on_bytes)
    return index
