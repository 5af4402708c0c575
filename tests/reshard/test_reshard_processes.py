"""Offline writers in forked processes: same bytes as threads, progress, and every way a child can fail."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from moeckpt.formats.checkpoint import CheckpointReader, verify
from moeckpt.formats.errors import ChecksumMismatchError, DataFileError, LayoutError
from moeckpt.reshard import executor, processes
from moeckpt.reshard.chunks import ChunkReader
from moeckpt.reshard.executor import reshard
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.options import ReshardOptions
from moeckpt.reshard.processes import WorkerProcessError, balanced_groups, run_forked
from moeckpt.trainer.models import presets

from ..helpers import flip_byte, init_qwen_105mb
from ..reshard_models import save_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not processes.can_fork(), reason="writer processes need fork (Linux)"),
]

SOURCE, TARGET = Layout(tp=2, ep=2, dp=2), Layout(tp=1, ep=4, dp=4)


@pytest.fixture
def source(tmp_path):
    save_model(str(tmp_path / "a"), presets()["zaya-tiny"], SOURCE)
    return tmp_path / "a"


@pytest.fixture
def forks(monkeypatch):
    """How many children each offline reshard forked (a spy on ``run_forked``)."""
    calls: list[int] = []

    def spy(groups, job, on_bytes=None):
        calls.append(len(groups))
        return run_forked(groups, job, on_bytes)

    monkeypatch.setattr(executor, "run_forked", spy)
    return calls


def _stored(location) -> dict:
    r = CheckpointReader(str(location))
    return {(p.file, p.tensor, p.box): r.read_piece(p).view(torch.uint8) for p in r.pieces()}


def test_processes_write_the_same_files_as_threads_and_report_progress(tmp_path, source, forks):
    seen: list[int] = []
    # Small chunks and cache: every writer process crosses many chunk boundaries and evicts.
    small = {"chunk_bytes": 4096, "slab_bytes": 8192, "cache_bytes": 64 * 1024}
    out = reshard(
        str(source), str(tmp_path / "p"), TARGET, on_bytes=seen.append, options=ReshardOptions(workers=3, **small)
    )
    # 4 target writers over at most 3 processes: writers that share source chunks go to one (each byte read once)
    assert len(forks) == 1 and 1 < forks[0] <= 3
    reshard(str(source), str(tmp_path / "t"), TARGET, options=ReshardOptions(workers=1, **small))  # one writer: threads
    assert len(forks) == 1
    assert sum(seen) == out.bytes_written == CheckpointReader(str(source)).index.nbytes
    assert verify(CheckpointReader(str(tmp_path / "p"))) == []
    assert out.bytes_read >= out.bytes_written  # the children's reads are counted
    by_procs, by_threads = _stored(tmp_path / "p"), _stored(tmp_path / "t")
    assert by_procs.keys() == by_threads.keys()
    for key, data in by_procs.items():
        assert torch.equal(data, by_threads[key]), key
    assert (tmp_path / "p" / "moeckpt.json").read_bytes() == (tmp_path / "t" / "moeckpt.json").read_bytes()


def test_zarr_targets_stay_in_threads(tmp_path, source, forks):
    reshard(str(source), str(tmp_path / "z"), TARGET, backend="zarr", options=ReshardOptions(workers=3))
    assert forks == []  # zarr keeps an event-loop thread a forked child would inherit dead
    assert verify(CheckpointReader(str(tmp_path / "z"))) == []


def test_a_corrupt_source_block_fails_in_the_child_with_the_checksum_error(tmp_path, source, forks):
    reader = CheckpointReader(str(source))
    ref = max(reader.pieces(), key=lambda p: p.nbytes)
    flip_byte(str(source), ref.file, ref.start + ref.nbytes // 2)
    with pytest.raises(ChecksumMismatchError, match=r"checksum mismatch in tensor .* the file is corrupt"):
        reshard(str(source), str(tmp_path / "b"), TARGET, options=ReshardOptions(workers=2))
    assert forks == [2]
    assert sorted(os.listdir(tmp_path)) == ["a"]  # neither the checkpoint nor its staging directory


def test_a_killed_writer_process_is_named_and_nothing_is_committed(tmp_path, source, forks, monkeypatch):
    write = executor._Writers.write

    def dies_on_writer_2(self, rank_plan, chunks, count):
        if rank_plan.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # in the child: its pid, not the test's
        return write(self, rank_plan, chunks, count)

    monkeypatch.setattr(executor._Writers, "write", dies_on_writer_2)
    with pytest.raises(WorkerProcessError, match=r"writer process \d+ ended without a result \(killed by signal 9\)"):
        reshard(str(source), str(tmp_path / "b"), TARGET, options=ReshardOptions(workers=4))
    assert len(forks) == 1 and forks[0] > 1  # writers sharing source chunks share a process
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_a_truncated_source_file_is_a_data_file_error_not_a_crash(source):
    """Mapped reads check the file's length first: touching a mapping past the end would kill the process."""
    reader = CheckpointReader(str(source))
    refs = {(p.tensor, p.box): p for p in reader.pieces()}
    last = max(refs.values(), key=lambda p: (p.file, p.start))
    os.truncate(source / last.file, last.start + last.nbytes // 2)
    with ChunkReader(reader, refs, map_files=True) as chunks:
        with pytest.raises(DataFileError, match="the file is truncated"):
            chunks.rows(last.tensor, last.box, 0, last.box.shape[0])


def test_mapped_reads_equal_copied_reads_at_unaligned_offsets(source):
    reader = CheckpointReader(str(source))
    refs = {(p.tensor, p.box): p for p in reader.pieces()}
    assert any(p.start % 4 for p in refs.values() if p.dtype == "float32")  # safetensors offsets are not aligned
    with (
        ChunkReader(reader, refs, chunk_bytes=4096) as copied,
        ChunkReader(reader, refs, chunk_bytes=4096, map_files=True) as mapped,
    ):
        for tensor, box in refs:
            n = box.shape[0] if box.ndim else 1
            for lo in range(0, n, max(1, n // 3)):
                a = copied.rows(tensor, box, lo, n)
                b = mapped.rows(tensor, box, lo, n)
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (tensor, lo)


def test_balanced_groups_split_by_weight():
    groups = balanced_groups(["a", "b", "c", "d", "e"], [10, 1, 9, 2, 8], 2)
    # largest first, each to the lighter group: a | c, e | d, b  ->  13 and 17
    assert sorted(map(sorted, groups)) == [["a", "b", "d"], ["c", "e"]]
    assert balanced_groups(["a"], [5], 4) == [["a"]]  # never an empty group
    assert sum(map(len, balanced_groups(list(range(9)), [1] * 9, 4))) == 9


def test_child_errors_come_back_typed():
    def job(group, report):
        report(5)
        if group == ["layout"]:
            raise LayoutError("tp=3 does not divide 8 heads")
        if group == ["bug"]:
            raise ZeroDivisionError("division by zero")
        return {"ok": group}

    got = []
    assert run_forked([["x"], ["y"]], job, got.append) == [{"ok": ["x"]}, {"ok": ["y"]}]
    assert sum(got) == 10  # progress flushed at the end of each child
    with pytest.raises(LayoutError, match="tp=3 does not divide 8 heads"):
        run_forked([["x"], ["layout"]], job)
    with pytest.raises(WorkerProcessError, match="ZeroDivisionError: division by zero"):
        run_forked([["bug"]], job)


_RSS_SCRIPT = """
import json, os, sys
from moeckpt.reshard import executor
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.options import ReshardOptions

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

write_group = executor._Writers.write_group
groups_done = []
def measured(self, group, chunks, count):  # runs in a writer process: writers sharing source chunks, together
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from what the process holds now
    start = status("VmRSS")
    out = write_group(self, group, chunks, count)
    with open(os.path.join(sys.argv[3], f"{os.getpid()}-{group[0].rank}.json"), "w") as f:
        json.dump({"grew": status("VmHWM") - start, "first": not groups_done, "writers": len(group),
                   "bytes": sum(rp.nbytes for rp in group)}, f)
    groups_done.append(group[0].rank)
    return out
executor._Writers.write_group = measured
executor.reshard(sys.argv[1], sys.argv[2], Layout(tp=2, ep=2, dp=2), options=ReshardOptions(
    workers=2, chunk_bytes=1 << 20, slab_bytes=1 << 20, cache_bytes=4 << 20))
"""


def test_writer_processes_stream_in_bounded_memory(tmp_path, moeckpt_cli):
    """Each writer process holds its share of the chunk cache and a slab per writer, never its files: a 105 MB
    checkpoint resharded to 4 files by 2 processes grows a process by a fraction of the files it writes (measured
    from the process's resident memory when its writers start; mapped chunks count while they are mapped)."""
    import json
    import subprocess
    import sys

    src, nbytes = init_qwen_105mb(moeckpt_cli, tmp_path)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")  # freed buffers leave the process: peaks are holdings
    (tmp_path / "rss").mkdir()
    subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, src, str(tmp_path / "dst"), str(tmp_path / "rss")],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    reports = [json.loads(p.read_text()) for p in (tmp_path / "rss").iterdir()]
    assert sum(r["writers"] for r in reports) == 4
    # tp 1 -> 2: the two new TP ranks of each part read the same stored rows, so they run together in one process
    # (each stored byte read once; here the parts' ZeRO cuts share enough chunks that all four do), each with a
    # slab, over the process's share of the cache. A process's first group also pays its one-time costs (torch's
    # first copies and hashes: measured 16 MB of growth); a process holding its files would grow by all of them.
    for r in reports:
        mb = r["bytes"] / 1e6
        assert 0 < r["grew"] < r["bytes"] / 2, f"a writer process grew by {r['grew'] / 1e6:.1f} MB for {mb:.0f} MB"
    code, _, err = moeckpt_cli("diff", src, tmp_path / "dst")
    assert code == 0, err
