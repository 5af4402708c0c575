"""Offline resharding: any layout to any other, any format and storage, through the executor and the CLI."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeckpt.formats.checkpoint import CheckpointReader, verify
from moeckpt.reshard.chunks import ChunkReader
from moeckpt.reshard.executor import reshard
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.options import ReshardOptions
from moeckpt.trainer.models import presets

from ..helpers import init_qwen_105mb
from ..reshard_models import layouts, models, save_model

_n = itertools.count()


def _stored(location: str) -> dict:
    """Every stored piece keyed by (file, tensor, box offsets), with its bytes."""
    r = CheckpointReader(location)
    return {(p.file, p.tensor, p.box): r.read_piece(p) for p in r.pieces()}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_to_b_equals_full_tensors_and_back_to_a_is_bitwise_identical(tmp_path, data):
    spec = data.draw(models())
    a = data.draw(layouts(spec))
    b = data.draw(layouts(spec))
    middle = data.draw(st.sampled_from(["safetensors", "zarr"]))  # B in either format; A and C safetensors
    base = tmp_path / f"case{next(_n)}"
    tensors, values = save_model(str(base / "a"), spec, a)
    # Tiny chunks, slabs and cache: every piece crosses several slab and chunk boundaries.
    small = {"chunk_bytes": 64, "slab_bytes": 96, "cache_bytes": 512, "workers": 3}
    out = reshard(str(base / "a"), str(base / "b"), b, backend=middle, options=ReshardOptions(**small))
    assert out.bytes_written == sum(e.nbytes for e in tensors.values())
    rb = CheckpointReader(str(base / "b"))
    assert rb.index.layout == b.to_json() and rb.index.step == 11 and rb.index.train_state["consumed_samples"] == 352
    assert verify(rb) == []
    for name, full in values.items():
        assert torch.equal(rb.read_tensor(name), full), name
    reshard(str(base / "b"), str(base / "c"), a, backend="safetensors", options=ReshardOptions(**small))
    before, after = _stored(str(base / "a")), _stored(str(base / "c"))
    assert before.keys() == after.keys()  # same files hold the same pieces
    for key, t in before.items():
        assert torch.equal(t.view(torch.uint8), after[key].view(torch.uint8)), key


def test_expert_ids_survive_any_ep(tmp_path):
    """Expert e of the source is expert e of the target at every ep: no local renumbering."""
    spec = presets()["zaya-tiny"]  # 4 experts
    _, values = save_model(str(tmp_path / "a"), spec, Layout(tp=1, ep=4, dp=4))
    reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout(tp=2, ep=2, dp=2))
    reader = CheckpointReader(str(tmp_path / "b"))
    name = "model.layers.1.mlp.experts.down_proj"
    for ref in reader.pieces(tensors=[name]):
        e0 = ref.box.offsets[0]
        assert torch.equal(reader.read_piece(ref), values[name][ref.box.slices()])
        assert e0 in (0, 2)  # ep=2 over 4 experts: global ids 0-1 and 2-3


def test_formats_and_storages_round_trip(tmp_path, storage_url):
    """safetensors (local) -> zarr on each storage -> safetensors (local): identical tensors, valid checkpoints."""
    spec = presets()["qwen3moe-tiny"]
    _, values = save_model(str(tmp_path / "a"), spec, Layout(tp=2, ep=2, dp=2))
    reshard(
        str(tmp_path / "a"), storage_url, Layout(tp=1, ep=4, dp=4), backend="zarr", options=ReshardOptions(workers=2)
    )
    mid = CheckpointReader(storage_url)
    assert mid.index.backend == "zarr" and verify(mid) == []
    reshard(storage_url, str(tmp_path / "c"), Layout(tp=2, ep=1, dp=3), backend="safetensors")
    back = CheckpointReader(str(tmp_path / "c"))
    for name, full in values.items():
        assert torch.equal(back.read_tensor(name), full), name


def test_cache_stays_within_budget(tmp_path):
    spec = presets()["zaya-tiny"]
    save_model(str(tmp_path / "a"), spec, Layout(tp=2, ep=1, dp=2))
    reader = CheckpointReader(str(tmp_path / "a"))
    refs = {(r.tensor, r.box): r for r in reader.pieces()}
    chunks = ChunkReader(reader, refs, chunk_bytes=4096, cache_bytes=16384)
    for tensor, box in refs:
        if box.ndim:
            chunks.rows(tensor, box, 0, box.shape[0])
    assert 0 < chunks.peak_cached <= 16384 + 4096 * 2  # the budget plus the chunk just read
    assert chunks.bytes_read >= sum(r.nbytes for r in refs.values() if r.box.ndim)


def test_cli_reshard_run_dir_and_errors(tmp_path, moeckpt_cli):
    run = tmp_path / "run"
    spec = presets()["zaya-tiny"]
    save_model(str(run / "step-00000010"), spec, Layout(tp=2, ep=2, dp=2))
    _, values = save_model(str(run / "step-00000020"), spec, Layout(tp=1, ep=1, dp=1), seed=5)
    code, out, err = moeckpt_cli("reshard", run, tmp_path / "out", "--tp", 2, "--ep", 4, "--dp", 4, "--workers", 2)
    assert code == 0, err
    assert "tp=2 ep=4 dp=4" in out
    reader = CheckpointReader(str(tmp_path / "out"))
    name = "model.embed_tokens.weight"
    assert torch.equal(reader.read_tensor(name), values[name])  # the newest step was resharded
    code, _, err = moeckpt_cli("reshard", run, tmp_path / "out", "--tp", 2)
    assert code == 2 and "not empty" in err and "--overwrite" in err
    assert moeckpt_cli("reshard", run, tmp_path / "out", "--tp", 2, "--overwrite")[0] == 0
    code, _, err = moeckpt_cli("reshard", run, tmp_path / "bad", "--tp", 3)
    assert code == 2 and "num_key_value_heads" in err and len(err.strip().splitlines()) == 1
    code, _, err = moeckpt_cli("reshard", run, tmp_path / "bad", "--ep", 3, "--dp", 3)
    assert code == 2 and "num_experts" in err
    assert not (tmp_path / "bad").exists()
    code, _, err = moeckpt_cli("reshard", tmp_path / "nothing", tmp_path / "x")
    assert code == 2 and "nothing" in err
    code, _, err = moeckpt_cli("reshard", tmp_path / "out", tmp_path / "out", "--overwrite")
    assert code == 2 and "source" in err


def test_reshard_from_zarr_source_to_world_size_one(tmp_path):
    spec = presets()["zaya-tiny"]
    _, values = save_model(str(tmp_path / "a"), spec, Layout(tp=2, ep=4, dp=4), backend="zarr")
    out = reshard(str(tmp_path / "a"), str(tmp_path / "b"), Layout(), backend="safetensors")
    assert len(out.index.files) == 1
    reader = CheckpointReader(str(tmp_path / "b"))
    for name, full in values.items():
        assert torch.equal(reader.read_tensor(name), full), name


@pytest.mark.parametrize("dst_kind", ["memory"])
def test_streaming_writer_to_object_store(tmp_path, dst_kind):
    spec = presets()["zaya-tiny"]
    _, values = save_model(str(tmp_path / "a"), spec, Layout(tp=2, ep=2, dp=2))
    url = f"memory://reshard-tests/{next(_n)}/ckpt"
    reshard(str(tmp_path / "a"), url, Layout(tp=1, ep=2, dp=4), options=ReshardOptions(slab_bytes=256))
    reader = CheckpointReader(url)
    assert verify(reader) == []
    for name, full in values.items():
        assert torch.equal(reader.read_tensor(name), full), name


def test_corrupt_or_missing_source_fails_cleanly(tmp_path, moeckpt_cli):
    spec = presets()["zaya-tiny"]
    save_model(str(tmp_path / "a"), spec, Layout(tp=2, ep=2, dp=2))
    victim = tmp_path / "a" / "rank-00002.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF  # one flipped bit pattern inside the data, the header intact
    victim.write_bytes(bytes(raw))
    code, _, err = moeckpt_cli("reshard", tmp_path / "a", tmp_path / "out", "--tp", 1)
    assert code == 1 and "rank-00002.safetensors" in err and "checksum mismatch" in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no output, no staging directory left
    victim.unlink()
    code, _, err = moeckpt_cli("reshard", tmp_path / "a", tmp_path / "out", "--tp", 1)
    assert code == 2 and "rank-00002.safetensors" in err and "missing" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


_RSS_SCRIPT = """
import resource, sys
from moeckpt.formats.backends import zarr  # imported before the baseline: zarr's own import is not the reshard
from moeckpt.reshard import executor
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.options import ReshardOptions
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
executor.reshard(sys.argv[1], sys.argv[2], Layout(), backend="zarr", options=ReshardOptions(
    workers=1, chunk_bytes=1 << 20, slab_bytes=1 << 20, cache_bytes=4 << 20, write_batch_bytes=1 << 20))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
def test_zarr_target_streams_in_bounded_memory(tmp_path, moeckpt_cli):
    """A reshard into zarr hands the backend a writer's pieces in batches, not the writer's whole share.

    A 105 MB Qwen3-MoE (16 layers, largest tensor 4.2 MB) converted to zarr in layout (1, 1, 1), where one writer
    stores everything, with 1 MB batches: the peak RSS grows by under a third of the checkpoint (measured: 21 MB,
    a few 4.2 MB pieces and their copies; handing the writer's share whole added 128 MB). glibc's mmap threshold
    is pinned so that freed buffers leave the process and the peak measures what the resharder holds, not what
    the allocator keeps.
    """
    import os
    import subprocess
    import sys

    src, nbytes = init_qwen_105mb(moeckpt_cli, tmp_path)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, src, str(tmp_path / "dst")],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    added = int(out.stdout.strip().splitlines()[-1])
    assert added < nbytes / 3, f"reshard to zarr added {added / 1e6:.1f} MB to the peak RSS for {nbytes / 1e6:.1f} MB"
    code, _, err = moeckpt_cli("diff", src, tmp_path / "dst")
    assert code == 0, err


def test_cli_format_conversion_keeps_the_layout_and_every_bit(tmp_path, moeckpt_cli):
    """`moeckpt reshard SRC DST --format zarr` (issue 3's conversion): degrees not given keep the source's."""
    code, _, err = moeckpt_cli(
        "init",
        tmp_path / "s",
        "--model",
        "zaya-tiny",
        "--tp",
        2,
        "--ep",
        2,
        "--dp",
        4,
        "--with-optimizer",
        "--dtype",
        "bf16",
    )
    assert code == 0, err
    code, out, err = moeckpt_cli("reshard", tmp_path / "s", tmp_path / "z", "--format", "zarr")
    assert code == 0, err
    index = CheckpointReader(str(tmp_path / "z")).index
    assert (index.backend, index.layout) == ("zarr", {"tp": 2, "ep": 2, "dp": 4})
    code, out, err = moeckpt_cli("diff", tmp_path / "s", tmp_path / "z")
    assert code == 0 and out.startswith("identical"), out + err
    code, _, err = moeckpt_cli("reshard", tmp_path / "z", tmp_path / "back", "--format", "safetensors", "--dp", 2)
    assert code == 0, err
    index = CheckpointReader(str(tmp_path / "back")).index
    assert (index.backend, index.layout) == ("safetensors", {"tp": 2, "ep": 2, "dp": 2})
    assert moeckpt_cli("diff", tmp_path / "s", tmp_path / "back")[0] == 0
