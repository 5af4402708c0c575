"""Load-time resharding: a rank's local tensors, alone or collectively over a gloo process group."""

from __future__ import annotations

import itertools
import json
import os
import socket

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.reshard.executor import reshard
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state, local_tensors
from moeckpt.reshard.options import LoadOptions, ReshardOptions
from moeckpt.reshard.placement import model_parallel_boxes, rule_of
from moeckpt.trainer.local_world import run_local_world
from moeckpt.trainer.models import presets

from ..reshard_models import layouts, models, save_model

_n = itertools.count()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_load_agrees_with_offline_and_full_tensors(tmp_path, data):
    spec = data.draw(models())
    a = data.draw(layouts(spec))
    b = data.draw(layouts(spec))
    base = tmp_path / f"case{next(_n)}"
    tensors, values = save_model(str(base / "a"), spec, a)
    reshard(str(base / "a"), str(base / "b"), b)
    offline = CheckpointReader(str(base / "b"))
    reader = CheckpointReader(str(base / "a"))
    for rank in range(b.world):
        stats = LoadStats()
        state = load_rank_state(reader, b, rank, stats=stats, options=LoadOptions(chunk_bytes=128))
        for name, boxes in state.items():
            for box, t in boxes:
                assert torch.equal(t, values[name][box.slices()]), (name, rank)
                assert torch.equal(t, offline.read_box(name, box)), (name, rank)
        assert stats.bytes_read >= stats.bytes_needed > 0
        # The local form concatenates the boxes along the TP dim, as the trainer's local tensors do.
        local = local_tensors(state, tensors, b, rank)
        c = b.coords(rank)
        for name, t in local.items():
            rule = rule_of(tensors[name])
            if tensors[name].role == "param":
                mp_boxes = model_parallel_boxes(tensors[name], b, c.tp_rank, c.ep_rank)
                parts = [values[name][x.slices()] for x in mp_boxes]
                dim = rule.tp.dim if rule.tp is not None else 0
                expect = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
                assert torch.equal(t, expect), name
            elif not state[name]:
                assert t.shape[0] == 0  # an empty ZeRO part is an empty local tensor


def test_roles_select_what_is_read(tmp_path):
    spec = presets()["zaya-tiny"]
    tensors, _ = save_model(str(tmp_path / "a"), spec, Layout(tp=2, ep=2, dp=2))
    stats = LoadStats()
    state = load_rank_state(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=2), 1, roles={"param"}, stats=stats)
    assert state and all(tensors[n].role == "param" for n in state)
    params = sum(e.nbytes for e in tensors.values() if e.role == "param")
    assert stats.bytes_needed == params  # dp=2, tp=1: each rank holds every parameter whole


# -- collective mode: 4 processes over gloo --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, location: str, layout: dict, out_dir: str) -> None:
    import torch.distributed as dist

    target = Layout(**layout)
    together, alone = LoadStats(), LoadStats()
    # Small rounds so the exchange takes several all_to_all rounds.
    state = load_rank_state(
        location, target, rank, group=dist.group.WORLD, stats=together, options=LoadOptions(round_bytes=64 * 1024)
    )
    solo = load_rank_state(location, target, rank, stats=alone)
    own_stats = LoadStats()
    # Over the group without the exchange: each rank reads its own bytes, only the outcome is agreed.
    own = load_rank_state(location, target, rank, group=dist.group.WORLD, exchange=False, stats=own_stats)

    def equal(x, y):
        return x.keys() == y.keys() and all(
            a[0] == b[0] and torch.equal(a[1], b[1]) for n in x for a, b in zip(x[n], y[n])
        )

    same = equal(state, solo) and equal(own, solo) and own_stats.bytes_read == alone.bytes_read
    reader = CheckpointReader(location)
    exact = all(torch.equal(t, reader.read_box(n, box)) for n, boxes in state.items() for box, t in boxes)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "same": same,
                "exact": exact,
                "together": together.bytes_read,
                "alone": alone.bytes_read,
                "needed": together.bytes_needed,
                "rounds": together.rounds,
            },
            f,
        )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["safetensors", "zarr"])
def test_collective_load_reads_the_checkpoint_about_once(tmp_path, backend):
    spec = presets()["zaya-tiny"]
    # zarr at tp 2 stores ZAYA's fused conv bias (tp blocks of 32 and 16) as 16-element cells: placements span cells
    tensors, _ = save_model(str(tmp_path / "a"), spec, Layout(tp=2, ep=2, dp=2), backend=backend)
    target = Layout(tp=1, ep=2, dp=4)  # 4 ranks; parameters replicated 4x (2x for experts)
    run_local_world(_worker, 4, str(tmp_path / "a"), target.to_json(), str(tmp_path), timeout_s=300)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["same"] and r["exact"] for r in results)
    assert all(r["rounds"] > 1 for r in results)
    total = sum(e.nbytes for e in tensors.values())
    together = sum(r["together"] for r in results)
    alone = sum(r["alone"] for r in results)
    assert together <= 1.05 * total  # storage read once, whatever the number of replicas
    assert alone > 1.5 * total  # each rank alone re-reads the replicated parameters
    assert sum(r["needed"] for r in results) > total


@pytest.mark.parametrize(
    "preset, source, target",
    [
        ("qwen3moe-tiny", Layout(tp=1, ep=2, dp=2), Layout(tp=2, ep=1, dp=2)),
        # a placement that spans several zarr cells (ZAYA's fused q/k conv bias at tp 2), same layout and another
        ("zaya-tiny", Layout(tp=2, ep=2, dp=2), Layout(tp=2, ep=2, dp=2)),
        ("zaya-tiny", Layout(tp=2, ep=2, dp=2), Layout(tp=1, ep=1, dp=1)),
    ],
)
def test_load_from_zarr_source(tmp_path, preset, source, target):
    spec = presets()[preset]
    _, values = save_model(str(tmp_path / "z"), spec, source, backend="zarr")
    for rank in range(target.world):
        stats = LoadStats()
        state = load_rank_state(str(tmp_path / "z"), target, rank, stats=stats)
        assert stats.bytes_read >= stats.bytes_needed > 0
        for name, boxes in state.items():
            for box, t in boxes:
                assert torch.equal(t, values[name][box.slices()]), (name, rank)


def _load_damaged(rank: int, location: str, layout: dict, out_dir: str, exchange: bool) -> None:
    import torch.distributed as dist

    try:
        load_rank_state(
            location,
            Layout(**layout),
            rank,
            group=dist.group.WORLD,
            options=LoadOptions(round_bytes=64 * 1024),
            exchange=exchange,
        )
        outcome = {"error": None}
    except Exception as e:  # noqa: BLE001 - the test inspects which error each rank got
        outcome = {"error": type(e).__name__, "message": str(e)}
    with open(os.path.join(out_dir, f"damaged{rank}.json"), "w") as f:
        json.dump(outcome, f)


@pytest.mark.slow
@pytest.mark.parametrize("exchange", [True, False])
def test_a_damaged_piece_fails_every_rank_of_a_collective_load_alike(tmp_path, exchange):
    """One rank meets a checksum mismatch; the others must not wait for it in the exchange until the timeout, and
    all of them raise the same error class (so a trainer can fall back to an older checkpoint on every rank);
    without the exchange, the ranks that read clean bytes raise it too."""

    from ..helpers import flip_byte

    spec = presets()["zaya-tiny"]
    save_model(str(tmp_path / "a"), spec, Layout(tp=2, ep=2, dp=2))
    size = os.path.getsize(tmp_path / "a" / "rank-00001.safetensors")
    flip_byte(str(tmp_path / "a"), "rank-00001.safetensors", size - 3)  # in the data, not the header
    run_local_world(
        _load_damaged, 4, str(tmp_path / "a"), Layout(tp=1, ep=2, dp=4).to_json(), str(tmp_path), exchange, timeout_s=60
    )
    outcomes = [json.loads((tmp_path / f"damaged{r}.json").read_text()) for r in range(4)]
    assert {o["error"] for o in outcomes} == {"ChecksumMismatchError"}, outcomes
    assert all("rank-00001.safetensors" in o["message"] for o in outcomes), outcomes
    assert sum("could not read its part" not in o["message"] for o in outcomes) >= 1  # the rank that saw it


def test_a_rank_loading_alone_reads_about_what_it_needs(tmp_path, moeckpt_cli):
    """A ZeRO part is a slice of a stored piece's rows: reading whole 64 MB chunks read up to 8x the part at dp 8.

    Qwen3-MoE with a 32 MB embedding and head, checkpoint at (1, 1, 1): at dp 8 each rank's part of the AdamW
    moments is 4 MB of each, exactly checksum blocks, so what a rank reads alone must stay within 5% of it.
    """
    cfg = {
        "arch": "qwen3_moe",
        "config": {
            "vocab_size": 8192,
            "hidden_size": 1024,
            "num_hidden_layers": 1,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "moe_intermediate_size": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 512,
        },
    }
    (tmp_path / "m.json").write_text(json.dumps(cfg))
    code, _, err = moeckpt_cli("init", tmp_path / "c", "--model", tmp_path / "m.json", "--with-optimizer")
    assert code == 0, err
    target = Layout(tp=1, ep=1, dp=8)
    for rank in (0, 3, 7):
        stats = LoadStats()
        load_rank_state(
            str(tmp_path / "c"),
            target,
            rank,
            roles={"exp_avg", "exp_avg_sq"},
            tensors=["exp_avg/model.embed_tokens.weight", "exp_avg_sq/lm_head.weight"],
            stats=stats,
        )
        assert stats.bytes_needed == 2 * 4 * 1024 * 1024
        assert stats.bytes_read <= 1.05 * stats.bytes_needed, (rank, stats)


def test_loads_and_reshards_keep_the_cyclic_collector_paused_and_restore_it(tmp_path, monkeypatch):
    """A full collection walks every object of the process (torch's included): the index parse and planning's
    many small objects triggered two per rank per load, a fifth of a 4-rank load's time. The collector is off
    from the index's parse to the end, then back on."""
    import gc

    from moeckpt.formats.index import Index
    from moeckpt.reshard import executor, load

    save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=2, ep=2, dp=2))
    enabled: list[tuple[str, bool]] = []

    def watch(name, fn):
        def wrapped(*args, **kwargs):
            enabled.append((name, gc.isenabled()))
            return fn(*args, **kwargs)

        return wrapped

    loads = Index.loads.__func__
    monkeypatch.setattr(Index, "loads", classmethod(watch("index", loads)))
    monkeypatch.setattr(load, "plan_load", watch("plan_load", load.plan_load))
    monkeypatch.setattr(executor, "plan_reshard", watch("plan_reshard", executor.plan_reshard))
    assert gc.isenabled()
    load_rank_state(str(tmp_path / "a"), Layout(tp=1, ep=4, dp=4), 1)
    assert gc.isenabled()
    reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout(tp=1, ep=2, dp=2), options=ReshardOptions(workers=1))
    assert gc.isenabled()
    assert {name for name, _ in enabled} == {"index", "plan_load", "plan_reshard"}
    assert not any(on for _, on in enabled), enabled


def test_the_exchange_pays_only_off_one_host_or_off_local_storage(monkeypatch):
    """The policy a resume follows (``--resume-reads auto``), over a real 1-rank gloo group."""
    import torch.distributed as dist

    from moeckpt.reshard import load
    from moeckpt.reshard.load import exchange_pays

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert exchange_pays("/some/run/step-00000010", group) is False  # one host, the page cache shares reads
        assert exchange_pays("s3://bucket/run/step-00000010", group) is True  # no shared cache for objects
        monkeypatch.setattr(load, "all_gather_json", lambda value, group: [value, "another-host"])
        assert exchange_pays("/some/run/step-00000010", group) is True  # ranks on two hosts
    finally:
        dist.destroy_process_group()
