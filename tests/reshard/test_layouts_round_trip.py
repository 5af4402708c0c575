"""Every layout in tp x ep x dp = {1,2} x {1,2,4} x {1,2,4} round-trips the real model plans against full tensors."""

from __future__ import annotations

import itertools

import pytest

from moeckpt.formats.box import covers_exactly_once
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import pieces_written_by, placements, rank_boxes
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.trainer.init_values import initial_value
from moeckpt.trainer.models import resolve_model

from ..helpers import tensors_equal

LAYOUTS = [
    Layout(tp=tp, ep=ep, dp=dp) for tp, ep, dp in itertools.product((1, 2), (1, 2, 4), (1, 2, 4)) if dp % ep == 0
]


def _model(preset: str):
    spec = resolve_model(preset)
    params = spec.param_specs()
    init = {p.name: p.init for p in params}
    tensors = logical_tensors(params, param_dtype="bfloat16", with_optimizer=True)
    return spec, tensors, (lambda e: initial_value(e, seed=3, init=init[e.param]))


@pytest.mark.parametrize("preset", ["zaya-tiny", "qwen3moe-tiny"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_layout_round_trip(tmp_path, preset, layout):
    spec, tensors, values = _model(preset)
    spec.check_layout(layout.tp, layout.ep)
    save_full_tensors(str(tmp_path / "c"), tensors=tensors, layout=layout, values=values, model=spec.to_json())
    reader = CheckpointReader(str(tmp_path / "c"))
    pieces = reader.pieces()
    by_tensor: dict[str, list] = {}
    for ref in pieces:
        by_tensor.setdefault(ref.tensor, []).append(ref)
    for name, entry in tensors.items():
        full = values(entry)
        refs = by_tensor.get(name, [])
        # stored once: the pieces tile the tensor exactly, and each sits in its writer's file
        assert covers_exactly_once(entry.shape, [r.box for r in refs]) is None, name
        assert tensors_equal(reader.read_box(name, _full(entry), refs), full), name
        for rank in range(layout.world):
            for box in rank_boxes(entry, layout, rank):
                assert tensors_equal(reader.read_box(name, box, refs), full[box.slices()]), (name, rank)
    for ref in pieces:
        writer = int(ref.file.split("-")[1].split(".")[0])
        assert ref.box in pieces_written_by(tensors[ref.tensor], layout, writer)


def test_replicated_writes_are_spread_over_replicas():
    _, tensors, _ = _model("zaya-tiny")
    layout = Layout(tp=1, ep=1, dp=4)
    written = [0] * layout.world
    for e in tensors.values():
        for p in placements(e, layout):
            written[p.writer] += p.box.numel
    assert max(written) / min(written) < 1.5, written


def test_expert_boxes_use_global_expert_ids():
    _, tensors, _ = _model("zaya-tiny")
    entry = tensors["model.layers.0.mlp.experts.gate_up_proj"]
    layout = Layout(tp=1, ep=4, dp=4)
    starts = sorted({b.offsets[0] for r in range(4) for b in rank_boxes(entry, layout, r)})
    assert starts == [0, 1, 2, 3]  # rank r holds global expert r, never a renumbered local expert 0


def test_zero_parts_uneven_and_empty():
    from moeckpt.formats.box import Box
    from moeckpt.reshard.placement import zero_part

    boxes = [Box((0, 0), (5, 4))]
    parts = [zero_part(boxes, 1, 4, i) for i in range(4)]
    assert [sum(b.shape[0] for b in p) for p in parts] == [2, 2, 1, 0]
    fused = [Box((0, 0), (3, 4)), Box((10, 0), (3, 4))]  # TP blocks concatenated along dim 0
    parts = [zero_part(fused, 0, 4, i) for i in range(4)]
    assert parts[1] == [Box((2, 0), (1, 4)), Box((10, 0), (1, 4))]  # a part straddling two blocks is two boxes
    assert sum(b.numel for p in parts for b in p) == 24


def _full(entry):
    from moeckpt.formats.box import Box

    return Box.full(entry.shape)
