"""Golden bytes of format version 2 (device meshes), and the spec's read-without-moeckpt snippet on them.

The state: what four ranks of an FSDP2 + TP run on a 2 x 2 mesh would save (a strided-sharded weight, a bias
sharded on one mesh dimension, a scalar tensor and a value every rank holds). If this fails, the format changed:
update docs/format.md and regenerate with ``python -m tests.formats.test_golden_v2`` only if the change is intended.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from moeckpt.formats.checkpoint import CheckpointReader, save_pieces, verify
from moeckpt.formats.pieces import Piece
from moeckpt.library.state_save import _merge
from moeckpt.reshard.mesh import entry_pieces

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "v2")
FILES = [
    "moeckpt.json",
    "rank-00000.safetensors",
    "rank-00001.safetensors",
    "rank-00002.safetensors",
    "rank-00003.safetensors",
]
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "format.md")


def _full() -> dict[str, torch.Tensor]:
    return {
        "model.w": torch.arange(24, dtype=torch.float32).reshape(6, 4),
        "model.b": torch.arange(4, dtype=torch.bfloat16) + 100,
        "optim.state.w.step": torch.tensor(3.0),
    }


def _descriptions() -> list[list]:
    mesh = [[2, 2], [0, 1, 2, 3]]
    rank = [
        ["model.b", "dtensor", [4], "bfloat16", *mesh, ["S(0)", "R"]],
        ["model.w", "dtensor", [6, 4], "float32", *mesh, ["SS(0,2)", "S(0)"]],
        ["optim.state.w.step", "tensor", [], "float32", [], [], []],
        ["step", "value", 3],
    ]
    return [rank for _ in range(4)]


def write_golden(location: str) -> None:
    index, _ = _merge(_descriptions(), backend="safetensors", step=3, model=None)
    full = _full()
    by_writer: dict[int, list[Piece]] = {r: [] for r in range(4)}
    for name, entry in index.tensors.items():
        for box, writer in entry_pieces(entry):
            by_writer[writer].append(Piece(name, box, full[name][box.slices()]))
    save_pieces(location, index, by_writer)


def test_bytes_match_golden(tmp_path):
    write_golden(str(tmp_path / "c"))
    for name in FILES:
        with open(os.path.join(GOLDEN, name), "rb") as f:
            want = f.read()
        with open(tmp_path / "c" / name, "rb") as f:
            got = f.read()
        assert got == want, f"{name} differs from the golden file"


@pytest.mark.slow
def test_four_real_ranks_saving_that_state_write_the_golden_bytes(tmp_path):
    from moeckpt.trainer.local_world import run_local_world

    from ..library_workers import save_golden_state

    run_local_world(save_golden_state, 4, str(tmp_path / "c"))
    for name in FILES:
        with open(os.path.join(GOLDEN, name), "rb") as f, open(tmp_path / "c" / name, "rb") as g:
            assert g.read() == f.read(), name


def test_golden_reads_back_and_verifies():
    reader = CheckpointReader(GOLDEN)
    assert reader.index.format_version == 2 and reader.index.train_state == {"step": 3}
    for name, value in _full().items():
        assert torch.equal(reader.read_tensor(name), value), name
    assert verify(reader) == []


def test_the_specs_snippet_reassembles_every_tensor_with_json_and_safetensors_only(tmp_path):
    text = open(DOCS).read()
    snippet = re.search(r"## Reading a checkpoint without moeckpt\n\n```python\n(.*?)```", text, re.S).group(1)
    for name, value in _full().items():
        scope: dict = {}
        exec(
            snippet.replace('"path/to/checkpoint"', repr(GOLDEN)).replace('"model.embed_tokens.weight"', repr(name)),
            scope,
        )
        assert torch.equal(scope["full"], value), name


if __name__ == "__main__":  # regenerate: python -m tests.formats.test_golden_v2
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp()
    write_golden(os.path.join(tmp, "c"))
    os.makedirs(GOLDEN, exist_ok=True)
    for name in FILES:
        shutil.copy(os.path.join(tmp, "c", name), os.path.join(GOLDEN, name))
    print(f"wrote {len(FILES)} golden files to {GOLDEN}", file=sys.stderr)


def test_inspect_names_the_meshes_of_a_state_dict_checkpoint(moeckpt_cli):
    """A checkpoint without a trainer layout says so, and lists its meshes and how its tensors are sharded."""
    code, out, _ = moeckpt_cli("inspect", GOLDEN)
    assert code == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("layout"))
    assert "none (a state-dict checkpoint)" in line
    assert "mesh 0 2x2 over 4 ranks" in line and "mesh 1 4 over 4 ranks" in line
    assert "mesh 0: 2" in line and "mesh 1: 1" in line
    code, out, _ = moeckpt_cli("inspect", GOLDEN, "--json")
    info = json.loads(out)
    assert info["meshes"][0]["shape"] == [2, 2] and info["shardings"] == {"mesh 0": 2, "mesh 1": 1}
