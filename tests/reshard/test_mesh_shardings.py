"""Mesh shardings: the boxes computed from a DTensor's placements equal what torch's DTensor holds on each rank.

torch is the reference: every rank's ``distribute_tensor(...).to_local()`` of a ``torch.arange`` tensor, in a fake
process group (one process plays each rank in turn; ``src_data_rank=None`` splits locally without collectives),
must equal the concatenation of our boxes of the full tensor. Hypothesis draws shapes, meshes and placements,
uneven and empty shards and FSDP2 + TP's strided shards included.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from moeckpt.formats.box import covers_exactly_once
from moeckpt.formats.errors import LayoutError
from moeckpt.reshard.mesh import (
    MeshPlacement,
    local_boxes,
    mesh_geometry,
    mesh_local_shape,
    parse_placements,
)

pytest.importorskip("torch.distributed.tensor")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore


def _torch_placement(p: MeshPlacement):
    if p.kind == "R":
        return Replicate()
    if p.kind == "S":
        return Shard(p.dim)
    return _StridedShard(p.dim, split_factor=p.split_factor)


def torch_locals(full: torch.Tensor, mesh_shape, placements) -> list[torch.Tensor]:
    """Each rank's local tensor as torch's DTensor computes it."""
    world = math.prod(mesh_shape)
    out = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", tuple(mesh_shape))
            d = distribute_tensor(full, mesh, [_torch_placement(p) for p in placements], src_data_rank=None)
            out.append(d.to_local().clone())
        finally:
            dist.destroy_process_group()
    return out


def ours(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """The local tensor assembled from our boxes, each at its local offsets."""
    shape = mesh_local_shape(full.shape, mesh_shape, coord, placements)
    local = torch.full(shape, -1, dtype=full.dtype)
    for box, offs in local_boxes(full.shape, mesh_shape, coord, placements):
        local[tuple(slice(o, o + s) for o, s in zip(offs, box.shape))] = full[box.slices()]
    return local


def coords(mesh_shape):
    world = math.prod(mesh_shape)
    for flat in range(world):
        c, rest = [], flat
        for n in reversed(mesh_shape):
            rest, r = divmod(rest, n)
            c.append(r)
        yield flat, list(reversed(c))


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 9)) for _ in range(ndim)]
    mesh_ndim = draw(st.integers(1, 3))
    mesh_shape = [draw(st.integers(1, 3)) for _ in range(mesh_ndim)]
    placements = []
    for i in range(mesh_ndim):
        kind = draw(st.sampled_from(["R", "S", "SS"]))
        if kind == "R":
            placements.append(MeshPlacement("R"))
        elif kind == "S":
            placements.append(MeshPlacement("S", draw(st.integers(0, ndim - 1))))
        else:
            # torch shards strided dims evenly only (its _shard_tensor refuses padding): keep to the FSDP2 + TP case,
            # a strided shard followed by a shard of the same dim whose mesh size is the split factor.
            if i + 1 < mesh_ndim:
                d = draw(st.integers(0, ndim - 1))
                placements.append(MeshPlacement("SS", d, mesh_shape[i + 1]))
            else:
                placements.append(MeshPlacement("R"))
    # Follow every strided shard with the shard it stands for (FSDP2 + TP: _S(d, tp), S(d)).
    for i, p in enumerate(placements):
        if p.kind == "SS" and i + 1 < mesh_ndim:
            placements[i + 1] = MeshPlacement("S", p.dim)
    return shape, mesh_shape, placements


@settings(max_examples=60, deadline=None)
@given(cases())
def test_boxes_equal_torch_dtensor_locals(case):
    shape, mesh_shape, placements = case
    full = torch.arange(max(1, math.prod(shape)), dtype=torch.int32)[: math.prod(shape)].reshape(shape)
    expected = torch_locals(full, mesh_shape, placements)
    for flat, coord in coords(mesh_shape):
        got = ours(full, mesh_shape, coord, placements)
        assert tuple(got.shape) == tuple(expected[flat].shape), (coord, placements)
        assert torch.equal(got, expected[flat]), (coord, placements)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_distinct_boxes_tile_the_tensor_and_holders_are_the_ranks_holding_them(case):
    shape, mesh_shape, placements = case
    geo = mesh_geometry(shape, mesh_shape, placements)
    assert covers_exactly_once(shape, geo.boxes) is None
    held: dict = {}
    for flat, coord in coords(mesh_shape):
        for box, _ in local_boxes(shape, mesh_shape, coord, placements):
            if not box.is_empty():
                held.setdefault(box, []).append(flat)
    assert {b: tuple(sorted(h)) for b, h in held.items()} == dict(zip(geo.boxes, geo.holders))


def test_fsdp2_tp_strided_shard_of_uneven_rows():
    # 6 rows, TP 2 then FSDP 2 (mesh dp x tp): each TP half of 3 rows splits 2 + 1 over dp.
    placements = [MeshPlacement("SS", 0, 2), MeshPlacement("S", 0)]
    rows = {
        tuple(c): [(b.offsets[0], b.shape[0]) for b, _ in local_boxes((6, 8), (2, 2), c, placements)]
        for _, c in coords((2, 2))
    }
    assert rows == {(0, 0): [(0, 2)], (0, 1): [(3, 2)], (1, 0): [(2, 1)], (1, 1): [(5, 1)]}


def test_a_strided_shard_alone_holds_several_boxes_concatenated():
    placements = [MeshPlacement("SS", 0, 2)]
    boxes = local_boxes((8, 2), (2,), (1,), placements)
    assert [(b.offsets, b.shape, o) for b, o in boxes] == [((2, 0), (2, 2), (0, 0)), ((6, 0), (2, 2), (2, 0))]


def test_scalars_are_one_empty_box_everywhere():
    assert local_boxes((), (4,), (3,), [MeshPlacement("R")]) == [(local_boxes((), (1,), (0,), [])[0][0], ())]


@pytest.mark.parametrize("bad", ["Q", "S", "S(x)", "S(1,2)", "SS(1)", "SS(0,0)", 3, None, "S(-1)", "S(99999)"])
def test_malformed_placements_are_refused_with_one_line(bad):
    with pytest.raises(LayoutError) as e:
        parse_placements([bad], ndim=2, mesh_ndim=1, where="tensor 'w'")
    assert "tensor 'w'" in str(e.value) and "\n" not in str(e.value)


def test_placements_must_match_the_mesh_and_the_tensor():
    with pytest.raises(LayoutError, match="one placement per mesh dimension"):
        parse_placements(["R"], ndim=2, mesh_ndim=2, where="w")
    with pytest.raises(LayoutError, match="dim 2 of a 2-d tensor"):
        parse_placements(["S(2)"], ndim=2, mesh_ndim=1, where="w")


def test_a_1024_rank_mesh_costs_its_distinct_pieces():
    import time

    placements = [MeshPlacement("S", 0), MeshPlacement("R")]
    t0 = time.perf_counter()
    geo = mesh_geometry((4096, 1024), (128, 8), placements)
    assert len(geo.boxes) == 128 and all(len(h) == 8 for h in geo.holders)
    assert time.perf_counter() - t0 < 5  # a sanity bound, far above the milliseconds it takes
