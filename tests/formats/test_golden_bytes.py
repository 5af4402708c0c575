"""Golden bytes: the on-disk format of docs/format.md, pinned byte for byte.

If this fails, the format changed: bump FORMAT_VERSION, update docs/format.md, and regenerate with
``python -m tests.formats.test_golden_bytes`` only if the change is intended.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.save import save_full_tensors

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")
FILES = ["moeckpt.json", "rank-00000.safetensors", "rank-00001.safetensors"]


def _tensors() -> dict[str, TensorEntry]:
    split = ShardingRule(tp=TpSplit(dim=0)).to_json()
    return {
        "w": TensorEntry(name="w", shape=(4, 2), dtype="float32", role="param", param="w", sharding=split),
        "exp_avg/w": TensorEntry(
            name="exp_avg/w", shape=(4, 2), dtype="float32", role="exp_avg", param="w", sharding=split
        ),
        "norm": TensorEntry(name="norm", shape=(3,), dtype="bfloat16", role="param", param="norm", sharding={}),
    }


def _value(entry: TensorEntry) -> torch.Tensor:
    base = {"w": 0.0, "exp_avg/w": 100.0, "norm": 1.0}[entry.name]
    n = 1
    for s in entry.shape:
        n *= s
    return (
        (torch.arange(n, dtype=torch.float32) + base)
        .reshape(entry.shape)
        .to(torch.bfloat16 if entry.dtype == "bfloat16" else torch.float32)
    )


def write_golden(location: str) -> None:
    save_full_tensors(
        location,
        tensors=_tensors(),
        layout=Layout(tp=2, dp=1),
        values=_value,
        model={"arch": "toy", "config": {"hidden_size": 2}},
        step=3,
        train_state={"step": 3},
    )


def test_bytes_match_golden(tmp_path):
    write_golden(str(tmp_path / "c"))
    for name in FILES:
        with open(os.path.join(GOLDEN, name), "rb") as f:
            want = f.read()
        with open(tmp_path / "c" / name, "rb") as f:
            got = f.read()
        assert got == want, f"{name} differs from tests/golden/{name}: the on-disk format changed"


def test_golden_files_read_with_plain_json_and_safetensors():
    """docs/format.md promises a checkpoint is readable with nothing but json and safetensors."""
    from safetensors import safe_open

    with open(os.path.join(GOLDEN, "moeckpt.json")) as f:
        index = json.load(f)
    assert index["format"] == "moeckpt" and index["format_version"] == 1
    full = torch.zeros(4, 2)
    for name in index["files"]:
        with safe_open(os.path.join(GOLDEN, name), framework="pt") as f:
            for key in f.keys():
                tensor, _, offsets = key.rpartition("@")
                if tensor == "w":
                    o = [int(x) for x in offsets.split(",")]
                    t = f.get_tensor(key)
                    full[o[0] : o[0] + t.shape[0], o[1] : o[1] + t.shape[1]] = t
    assert torch.equal(full, torch.arange(8, dtype=torch.float32).reshape(4, 2))


def test_golden_checkpoint_reads_and_verifies():
    reader = CheckpointReader(GOLDEN)
    for name, entry in reader.index.tensors.items():
        assert torch.equal(reader.read_tensor(name), _value(entry))


if __name__ == "__main__":  # regenerate (only for an intended, versioned format change)
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp()
    write_golden(os.path.join(tmp, "c"))
    for name in FILES:
        shutil.copy(os.path.join(tmp, "c", name), os.path.join(GOLDEN, name))
    print("regenerated", file=sys.stderr)
