"""Each member's part of a collective load's exchange plan, from the members' summaries, is that member's part of
the whole group's plan (``plan_exchange``): the same units, owners, transfers and rounds."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeckpt.formats.errors import LayoutError
from moeckpt.reshard.group_plan import ExchangePlan, plan_exchange
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state
from moeckpt.reshard.options import LoadOptions
from moeckpt.reshard.plan import source_pieces
from moeckpt.reshard.planner import plan_load
from moeckpt.reshard.rank_exchange import decide, rank_exchange, summarize
from moeckpt.reshard.source_lookup import SourcePositions
from moeckpt.trainer.models import presets

from ..reshard_models import layouts, models
from .test_reshard_planner import _index


def _view(whole: ExchangePlan, me: int):
    """Member ``me``'s part of the whole group's plan: the units it reads or needs, with the parts it sends
    (another member's piece position is not its business: -1) and those it keeps or receives."""
    keys = [k for k in whole.owner if whole.owner[k] == me or any(g == me for g, _, _ in whole.units[k])]
    units = {
        k: [(g, pos if g == me else -1, sub) for g, pos, sub in whole.units[k] if whole.owner[k] == me or g == me]
        for k in keys
    }
    relevant = set(keys)
    return units, {k: whole.owner[k] for k in keys}, [[k for k in r if k in relevant] for r in whole.rounds]


def _per_member(index, target, peers, chunk_bytes, round_bytes, readable=None, sources=None):
    """Every member's plan as the collective load makes it: its own load plan and summary, everyone's
    summaries (here in one process, as the all_gather gives them), the decisions, its part."""
    positions = SourcePositions(index, sources)
    summaries = [
        summarize(index, plan_load(index, target, [r], sources=sources).ranks[0], chunk_bytes, positions) for r in peers
    ]
    decisions = decide([(s.ids, s.nbytes, s.tags) for s in summaries], round_bytes, readable=readable)
    return [
        rank_exchange(index, target, peers, me, s, decisions, chunk_bytes, positions) for me, s in enumerate(summaries)
    ]


def _check(index, target, peers, chunk_bytes, round_bytes, readable=None, sources=None) -> None:
    whole = plan_exchange(
        index, plan_load(index, target, peers, sources=sources), chunk_bytes, round_bytes, readable=readable
    )
    for me, part in enumerate(_per_member(index, target, peers, chunk_bytes, round_bytes, readable, sources)):
        units, owner, rounds = _view(whole, me)
        assert part.owner == owner, me
        assert part.units == units, me
        assert part.rounds == rounds, me


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_each_members_part_is_its_part_of_the_whole_groups_plan(data):
    spec = data.draw(models())
    a, b = data.draw(layouts(spec)), data.draw(layouts(spec))
    index = _index(spec, a)
    chunk_bytes = data.draw(st.sampled_from([64, 1024, 1 << 20]))
    round_bytes = data.draw(st.sampled_from([256, 1 << 16, 1 << 30]))
    _check(index, b, list(range(b.world)), chunk_bytes, round_bytes)


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_a_group_of_some_layout_ranks_in_any_order_plans_as_the_whole_group_did(data):
    spec = data.draw(models())
    a, b = data.draw(layouts(spec)), data.draw(layouts(spec))
    index = _index(spec, a)
    peers = data.draw(st.permutations(range(b.world)))[: data.draw(st.integers(1, b.world))]
    _check(index, b, list(peers), data.draw(st.sampled_from([64, 4096])), data.draw(st.sampled_from([512, 1 << 20])))


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_members_that_read_only_some_files_plan_as_the_whole_group_did(data):
    """The memory tier's node-local checkpoints: each member reads the files of some writers only."""
    spec = data.draw(models())
    a, b = data.draw(layouts(spec)), data.draw(layouts(spec))
    index = _index(spec, a)
    readable = [
        data.draw(st.one_of(st.none(), st.sets(st.integers(0, a.world - 1), max_size=a.world))) for _ in range(b.world)
    ]
    readable[data.draw(st.integers(0, b.world - 1))] = set(range(a.world))  # some member can read every file
    _check(index, b, list(range(b.world)), data.draw(st.sampled_from([64, 1 << 20])), 1 << 16, readable)


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_explicit_stored_pieces_plan_as_the_whole_group_did(data):
    """Stored pieces given explicitly (zarr cells, DCP-written pieces: the lookup of pieces, not of a geometry),
    with members that read only some files (the owner of a unit it does not need decodes its number)."""
    spec = data.draw(models())
    a, b = data.draw(layouts(spec)), data.draw(layouts(spec))
    index = _index(spec, a)
    readable = None
    if data.draw(st.booleans()):
        readable = [data.draw(st.sets(st.integers(0, a.world - 1), max_size=a.world)) for _ in range(b.world)]
        readable[0] = set(range(a.world))
    _check(
        index, b, list(range(b.world)), data.draw(st.sampled_from([64, 4096])), 1 << 14, readable, source_pieces(index)
    )


def test_a_file_no_member_can_read_fails_every_member_alike():
    spec = presets()["zaya-tiny"]
    index = _index(spec, Layout(tp=2, ep=2, dp=2))
    target = Layout(tp=1, ep=4, dp=4)
    readable = [{0}, set(), set(), set()]
    with pytest.raises(LayoutError) as whole:
        plan_exchange(index, plan_load(index, target, range(4)), 1024, 1 << 16, readable=readable, location="ck")
    positions = SourcePositions(index)
    summaries = [summarize(index, plan_load(index, target, [r]).ranks[0], 1024, positions) for r in range(4)]
    with pytest.raises(LayoutError) as part:
        decide([(s.ids, s.nbytes, s.tags) for s in summaries], 1 << 16, readable=readable, location="ck")
    assert str(part.value) == str(whole.value)


def test_a_group_needing_nothing_still_agrees_on_one_round():
    """Every member takes part in every round: with nothing to load, there is one empty round, as before."""
    import numpy as np

    empty = np.zeros(0, np.int64)
    decisions = decide([(empty, empty, empty)] * 3, 1 << 20)
    assert decisions.round_starts.tolist() == [0] and len(decisions.ids) == 0


def test_layouts_of_the_benchmark_family_plan_as_the_whole_group_did():
    """tp, ep and dp all change (the 1,024-rank benchmark's change, on 16 ranks), with small chunks and rounds."""
    spec = presets()["zaya-tiny"]
    index = _index(spec, Layout(tp=1, ep=4, dp=16))
    _check(index, Layout(tp=2, ep=2, dp=8), list(range(16)), 4096, 1 << 15)


# -- the collective load through the new path: 4 processes over gloo --------------------------------------------
def _collective(rank: int, location: str, layout: dict, peers: list, readable, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from moeckpt.formats.checkpoint import CheckpointReader
    from moeckpt.reshard import load as load_module

    planned: list[int] = []  # ranks per load plan this member makes: its own only, whatever the group
    real = load_module.plan_load

    def counting(index, layout, ranks, **kw):
        ranks = list(ranks)
        planned.append(len(ranks))
        return real(index, layout, ranks, **kw)

    load_module.plan_load = counting
    target = Layout(**layout)
    stats = LoadStats()
    state = load_rank_state(
        location,
        target,
        peers[rank],
        group=dist.group.WORLD,
        peers=peers,
        stats=stats,
        readable=readable,
        options=LoadOptions(round_bytes=32 * 1024, chunk_bytes=8 * 1024),
    )
    load_module.plan_load = real
    reader = CheckpointReader(location)
    alone = load_rank_state(location, target, peers[rank])
    exact = all(torch.equal(t, reader.read_box(n, box)) for n, boxes in state.items() for box, t in boxes)
    same = state.keys() == alone.keys() and all(
        a[0] == b[0] and torch.equal(a[1], b[1]) for n in state for a, b in zip(state[n], alone[n])
    )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(
            {"exact": exact, "same": same, "read": stats.bytes_read, "rounds": stats.rounds, "planned": planned}, f
        )


@pytest.mark.slow
@pytest.mark.parametrize("readable", [None, [{0, 1}, {2}, {3}, set()]])
def test_a_collective_load_of_permuted_peers_reads_each_byte_about_once(tmp_path, readable):
    from moeckpt.trainer.local_world import run_local_world

    from ..reshard_models import save_model

    spec = presets()["zaya-tiny"]
    tensors, _ = save_model(str(tmp_path / "a"), spec, Layout(tp=2, ep=2, dp=2))
    target = Layout(tp=1, ep=2, dp=4)  # 4 target ranks, loaded by group ranks in another order
    peers = [2, 0, 3, 1]
    run_local_world(
        _collective, 4, str(tmp_path / "a"), target.to_json(), peers, readable, str(tmp_path), timeout_s=120
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["exact"] and r["same"] for r in results), results
    assert all(r["planned"] == [1] for r in results), results  # each member planned only its own boxes
    assert all(r["rounds"] == results[0]["rounds"] > 1 for r in results)
    total = sum(e.nbytes for e in tensors.values())
    assert sum(r["read"] for r in results) <= 1.05 * total


def _fail_planning(rank: int, location: str, out_dir: str) -> None:
    import torch.distributed as dist

    target = Layout(tp=1, ep=2, dp=4)
    # Rank 2 asks for a target layout the checkpoint's experts cannot take: its own planning fails.
    layout = Layout(tp=1, ep=8, dp=8) if rank == 2 else target
    try:
        load_rank_state(location, layout, rank, group=dist.group.WORLD)
        outcome = {"error": None}
    except Exception as e:  # noqa: BLE001 - the test inspects which error each rank got
        outcome = {"error": type(e).__name__, "message": str(e)}
    with open(os.path.join(out_dir, f"plan{rank}.json"), "w") as f:
        json.dump(outcome, f)


@pytest.mark.slow
def test_a_rank_whose_planning_fails_fails_every_rank_alike(tmp_path):
    """Each rank plans only its own boxes now: one rank's planning error must not leave the others waiting in the
    exchange; every rank raises that error, the same class and message."""
    from moeckpt.trainer.local_world import run_local_world

    from ..reshard_models import save_model

    save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=2, ep=2, dp=2))
    run_local_world(_fail_planning, 4, str(tmp_path / "a"), str(tmp_path), timeout_s=60)
    outcomes = [json.loads((tmp_path / f"plan{r}.json").read_text()) for r in range(4)]
    assert outcomes[0]["error"] == "LayoutError" and all(o == outcomes[0] for o in outcomes), outcomes
