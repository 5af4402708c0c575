"""Token files, the shipped corpus, and a data position that resumes exactly at any data-parallel degree."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from moeckpt.trainer.data import (
    DEMO_TEXT_BYTES,
    BatchLoader,
    DataError,
    TokenDataset,
    default_text_path,
    make_text,
    permutation,
    write_tokens,
)


def test_shipped_corpus_is_the_generator_output():
    with open(default_text_path(), "rb") as f:
        shipped = f.read()
    assert shipped == make_text(DEMO_TEXT_BYTES, seed=0).encode("ascii")
    ds = TokenDataset(default_text_path(), seq_len=64, vocab_size=256)
    assert ds.dtype == "bytes" and len(ds) == (DEMO_TEXT_BYTES - 1) // 64
    sample = ds.get([3])[0]
    assert bytes(sample.tolist()) == shipped[3 * 64 : 4 * 64 + 1]


@pytest.mark.parametrize("dtype,fmt", [("uint16", "<H"), ("uint32", "<I")])
def test_token_files_are_little_endian_and_cut_into_overlapping_samples(tmp_path, dtype, fmt):
    tokens = [(i * 7919) % 60000 + (70000 if dtype == "uint32" else 0) for i in range(101)]
    path = tmp_path / "train.bin"
    path.write_bytes(b"".join(struct.pack(fmt, t) for t in tokens))  # written by hand, not by write_tokens
    ds = TokenDataset(path, seq_len=10, dtype=dtype)
    assert len(ds) == 10
    batch = ds.get([0, 9, 4])
    assert batch.dtype == torch.int64 and batch.shape == (3, 11)
    assert batch[1].tolist() == tokens[90:101]
    assert batch[2].tolist() == tokens[40:51]
    # write_tokens produces the same bytes.
    write_tokens(tmp_path / "again.bin", tokens, dtype)
    assert (tmp_path / "again.bin").read_bytes() == path.read_bytes()
    loader = BatchLoader(ds, global_batch=2, shuffle=False)
    inputs, targets = loader.next()
    assert inputs.tolist() == [tokens[0:10], tokens[10:20]]
    assert targets.tolist() == [tokens[1:11], tokens[11:21]]


def test_bad_data_is_refused_with_what_and_where(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="odd.bin: size 3 bytes is not a multiple of 2"):
        TokenDataset(odd, seq_len=1)
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(DataError, match="short.txt: 3 tokens are fewer than one sample"):
        TokenDataset(short, seq_len=8)
    with pytest.raises(DataError, match="cannot tell the token format"):
        TokenDataset(tmp_path / "tokens.dat", seq_len=8)
    with pytest.raises(DataError, match="missing.bin: cannot read the data file"):
        TokenDataset(tmp_path / "missing.bin", seq_len=8)
    big = tmp_path / "big.bin"
    write_tokens(big, [1, 2, 3, 500, 4, 5, 6, 7, 8], "uint16")
    ds = TokenDataset(big, seq_len=2, vocab_size=256)
    ds.get([0])
    with pytest.raises(DataError, match="sample 1 holds token id 500 >= the model's vocab_size 256"):
        ds.get([0, 1])
    with pytest.raises(DataError, match="vocab_size >= 256"):
        TokenDataset(short, seq_len=1, vocab_size=100)
    with pytest.raises(DataError, match="global_batch=6 is not divisible by dp=4"):
        BatchLoader(ds, global_batch=6, dp=4)


def test_permutation_depends_on_seed_and_epoch_only():
    # Golden values: a change here breaks the resume of every existing run, so it must be deliberate.
    assert permutation(10, 0, 0).tolist() == [4, 8, 0, 1, 7, 6, 2, 5, 3, 9]
    assert permutation(10, 0, 1).tolist() == [4, 0, 1, 8, 5, 7, 9, 3, 2, 6]
    assert permutation(10, 1, 0).tolist() == [3, 5, 2, 4, 1, 9, 0, 6, 8, 7]
    p = permutation(100_003, 7, 2)
    assert np.array_equal(np.sort(p), np.arange(100_003))


def _step_union(loaders: list[BatchLoader]) -> list[list[int]]:
    """Every rank's next batch, concatenated in rank order (what the step trains on, globally)."""
    rows = []
    for loader in loaders:
        inputs, targets = loader.next()
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        rows.extend(torch.cat([inputs, targets[:, -1:]], dim=1).tolist())
    return rows


def test_every_dp_reads_the_same_global_batches_and_resumes_at_another_dp(tmp_path):
    # 10 samples of 32 + 1 bytes: the run crosses several epochs, each a different permutation.
    small_len, batch, steps = 10, 8, 6
    path = tmp_path / "small.txt"
    with open(default_text_path(), "rb") as f:
        path.write_bytes(f.read(small_len * 32 + 1))
    small = TokenDataset(path, seq_len=32)
    assert len(small) == small_len

    runs = {}
    for dp in (1, 2, 4):
        loaders = [BatchLoader(small, global_batch=batch, dp_rank=r, dp=dp, seed=3) for r in range(dp)]
        runs[dp] = [_step_union(loaders) for _ in range(steps)]
    assert runs[1] == runs[2] == runs[4]
    # Every epoch reads each of the 10 samples exactly once.
    flat = [tuple(row) for step in runs[1] for row in step]
    for e in range(len(flat) // small_len):
        assert len(set(flat[e * small_len : (e + 1) * small_len])) == small_len
    assert flat[:small_len] != flat[small_len : 2 * small_len]

    # Stop after 3 steps at dp=2, save as JSON, resume at dp=4 and at dp=1: the same samples follow.
    loaders = [BatchLoader(small, global_batch=batch, dp_rank=r, dp=2, seed=3) for r in range(2)]
    for _ in range(3):
        _step_union(loaders)
    state = json.loads(json.dumps(loaders[0].state_dict()))
    assert state["consumed_samples"] == 3 * batch
    for dp in (4, 1):
        resumed = [BatchLoader(small, global_batch=batch, dp_rank=r, dp=dp, seed=3) for r in range(dp)]
        for loader in resumed:
            loader.load_state_dict(state)
        assert [_step_union(resumed) for _ in range(3)] == runs[1][3:]
    # A different global batch still continues at the same sample.
    wide = [BatchLoader(small, global_batch=2 * batch, dp_rank=r, dp=2, seed=3) for r in range(2)]
    for loader in wide:
        loader.load_state_dict(state)
    assert _step_union(wide) == runs[1][3] + runs[1][4]


def test_resume_refuses_another_order_or_geometry():
    ds = TokenDataset(default_text_path(), seq_len=32)
    state = BatchLoader(ds, global_batch=4, seed=1).state_dict()
    with pytest.raises(DataError, match="saved seed=1 but this run has seed=2"):
        BatchLoader(ds, global_batch=4, seed=2).load_state_dict(state)
    other = TokenDataset(default_text_path(), seq_len=16)
    with pytest.raises(DataError, match="saved seq_len=32 but this run has seq_len=16"):
        BatchLoader(other, global_batch=4, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="consumed_samples"):
        BatchLoader(ds, global_batch=4, seed=1).load_state_dict({"consumed_samples": -4})
