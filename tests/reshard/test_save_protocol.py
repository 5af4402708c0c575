"""The engine's one save protocol: the order of its hooks, one error class for every caller, typed start errors."""

from __future__ import annotations

import os

import pytest
import torch

import moeckpt
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import DestinationNotEmptyError
from moeckpt.formats.index import Index, TensorEntry
from moeckpt.formats.pieces import Piece
from moeckpt.reshard.save_protocol import SaveFailedError, SaveHooks, save_collective


def _index() -> tuple[Index, list[Piece]]:
    entry = TensorEntry(name="w", shape=(4, 3), dtype="float32", role="param", param="w")
    index = Index(
        backend="safetensors",
        step=7,
        layout={"dp": 1},
        model={"arch": "toy", "config": {}},
        tensors={"w": entry},
        files={},
        train_state={},
    )
    return index, [Piece("w", Box((0, 0), (4, 3)), torch.arange(12, dtype=torch.float32).reshape(4, 3))]


def test_the_hooks_run_in_the_protocols_order_and_the_index_lists_what_was_written(tmp_path):
    where = str(tmp_path / "ckpt")
    index, pieces = _index()
    order: list[tuple] = []
    hooks = SaveHooks(
        before_begin=lambda: order.append(("before_begin", os.path.exists(where))),
        after_write=lambda written: order.append(("after_write", [f.path for f in written])),
        before_commit=lambda by_rank: order.append(("before_commit", [[f.path for f in r] for r in by_rank])),
        after_commit=lambda final: order.append(("after_commit", sorted(final.files), os.path.exists(where))),
    )
    final = save_collective(where, index, pieces, {"w": [pieces[0].box]}, hooks=hooks)
    assert order == [
        ("before_begin", False),
        ("after_write", ["rank-00000.safetensors"]),
        ("before_commit", [["rank-00000.safetensors"]]),
        ("after_commit", ["rank-00000.safetensors"], True),
    ]
    assert sorted(final.files) == ["rank-00000.safetensors"]
    assert torch.equal(CheckpointReader(where).read_tensor("w"), pieces[0].data)


def test_a_failure_after_the_write_commits_nothing_and_is_the_callers_class(tmp_path):
    class Mine(SaveFailedError):
        pass

    def boom(written):
        raise OSError("injected after the write")

    where = str(tmp_path / "ckpt")
    index, pieces = _index()
    with pytest.raises(Mine, match="rank 0: injected after the write") as caught:
        save_collective(where, index, pieces, hooks=SaveHooks(after_write=boom), failure=Mine)
    assert isinstance(caught.value, moeckpt.SaveFailedError)
    assert not os.path.exists(where)  # only the staging directory was made


def test_a_start_error_keeps_its_class_and_the_hooks_after_it_never_run(tmp_path):
    where = str(tmp_path / "ckpt")
    index, pieces = _index()
    save_collective(where, index, pieces)
    ran: list[str] = []
    with pytest.raises(DestinationNotEmptyError):
        save_collective(where, index, pieces, hooks=SaveHooks(after_write=lambda w: ran.append("write")))
    assert ran == []


def test_every_callers_save_error_is_moeckpts_one_class():
    from moeckpt.trainer import checkpointing, memory_tier

    assert checkpointing.SaveFailedError is moeckpt.SaveFailedError
    assert issubclass(memory_tier.MemorySaveError, moeckpt.SaveFailedError)
