"""Local tensors <-> boxes, for every rule kind and role."""

from __future__ import annotations

import itertools

import pytest

from moeckpt.reshard.layout import Layout
from moeckpt.reshard.local import join_local, local_shape, split_local
from moeckpt.reshard.placement import rank_boxes

from ..helpers import tensors_equal, toy_tensors, toy_values


@pytest.mark.parametrize("tp,ep,dp", [(1, 1, 1), (2, 1, 2), (2, 2, 2), (1, 4, 4), (2, 2, 4)])
def test_split_and_join_are_inverse(tp, ep, dp):
    layout = Layout(tp=tp, ep=ep, dp=dp)
    values = toy_values()
    for entry, rank in itertools.product(toy_tensors().values(), range(layout.world)):
        full = values(entry)
        boxes = rank_boxes(entry, layout, rank)
        local = join_local(entry, layout, rank, {b: full[b.slices()] for b in boxes})
        assert tuple(local.shape) == local_shape(entry, layout, rank)
        for box, view in split_local(entry, layout, rank, local):
            assert tensors_equal(view, full[box.slices()]), (entry.name, rank, box)


def test_fused_local_tensor_is_gate_part_then_up_part():
    entry = toy_tensors()["moe.experts.gate_up"]  # [4, 12, 8], blocks (6, 6) on dim 1
    layout = Layout(tp=2, ep=2, dp=2)
    full = toy_values()(entry)
    rank = layout.rank_of(tp_rank=1, dp_rank=1)  # tp 1, ep 1: experts 2..3, rows 3..5 of gate and of up
    local = join_local(entry, layout, rank, {b: full[b.slices()] for b in rank_boxes(entry, layout, rank)})
    assert tensors_equal(local[:, :3], full[2:4, 3:6]) and tensors_equal(local[:, 3:], full[2:4, 9:12])
