"""torchtitan's own ``CheckpointManager`` on the moeckpt format, through ``moeckpt.dcp`` (tests/titan_manager.py).

Run A: 4 gloo ranks, FSDP 2 x TP 2 x EP 2, torchtitan's tiny Qwen3-MoE with its optimizers, lr schedulers and
dataloader; the manager saves after steps 1 and 2 (``async_mode="async"``). Run B resumes from it on another mesh
(2 ranks, FSDP 2 x TP 1 x EP 2, through torchtitan's ``initial_load_path``, then saves step 3 synchronously) and on
the same mesh (4 ranks, torchtitan's resume from its checkpoint folder). Every rank compares what it restored with
what run A saved, bit for bit, and its third step with run A's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import moeckpt
from moeckpt.library.dcp_values import decode_value

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where the workers live


def _torchrun(nproc: int, *args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",  # the agent's store binds a port of the kernel's choosing (see test_dcp_import.py)
        os.path.join(HERE, "titan_workers.py"),
        *args,
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> str:
    pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan is not installed")
    out = str(tmp_path_factory.mktemp("titan") / "a")
    os.makedirs(out)
    _torchrun(4, "save", out, "2", "2", "2", "async")
    return out


def _ref(run_a: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    with open(os.path.join(run_a, "ref.json")) as f:
        return json.load(f), load_file(os.path.join(run_a, "ref.safetensors"))


def _stored_name(key: str) -> str:
    """A reference key (``model/<fqn>``, ``optim/<flat key>``) as the checkpoint names it."""
    kind, name = key.split("/", 1)
    return name if kind == "model" else f"optimizer.{name}"


@pytest.mark.slow
def test_the_manager_saves_committed_moeckpt_checkpoints(run_a, moeckpt_cli):
    ref, tensors = _ref(run_a)
    folder = os.path.join(run_a, "checkpoint")
    assert sorted(os.listdir(folder)) == ["step-1", "step-2"]
    for step in (1, 2):
        ckpt = os.path.join(folder, f"step-{step}")
        assert moeckpt.verify(ckpt) == []
        assert not [n for n in os.listdir(ckpt) if n.endswith((".distcp", ".metadata"))], "no DCP pickles"
        assert moeckpt.CheckpointReader(ckpt).index.step == step
    code, out, err = moeckpt_cli("inspect", folder)  # a run directory: its newest committed step
    assert code == 0, err
    assert "step-2" in out and "safetensors" in out
    assert moeckpt_cli("verify", os.path.join(folder, "step-2"))[0] == 0

    reader = moeckpt.CheckpointReader(os.path.join(folder, "step-2"))
    saved = {k: v for k, v in tensors.items() if k.startswith(("model/", "optim/"))}
    assert set(reader.index.tensors) == {_stored_name(k) for k in saved}
    params = [k[len("model/") :] for k in saved if k.startswith("model/") and f"optim/state.{k[6:]}.step" in saved]
    assert len(params) > 20
    for p in params:  # AdamW's state of every parameter, flattened by torchtitan's OptimizersContainer
        assert all(f"optim/state.{p}.{s}" in saved for s in ("exp_avg", "exp_avg_sq", "step")), p
    for key, want in saved.items():  # on disk: exactly what run A held in memory at step 2
        got = reader.read_tensor(_stored_name(key))
        assert got.dtype == want.dtype and torch.equal(
            got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)
        ), key
    values = reader.index.train_state
    assert values["train_state.step"] == 2 and values["lr_scheduler.last_epoch"] == 2
    assert values["dataloader.world_size"] == 2
    assert json.loads(values["dataloader.dp_rank_1"])["dataset_state"] == {"sample_idx": 4}
    # a tuple: stored typed in the version-3 index (docs/format.md), so that DCP's load gives a tuple back
    betas = values["optimizer.param_groups.tok_embeddings.weight.betas"]
    assert betas == {"$type": "tuple", "items": [0.9, 0.95]}
    assert decode_value(betas, reader.read_tensor, "betas") == (0.9, 0.95)


@pytest.mark.slow
def test_torchtitans_stock_dataloader_state_is_saved_as_bytes(run_a):
    ref, _ = _ref(run_a)
    # torchtitan's ParallelAwareDataloader pickles its state: moeckpt stores those bytes as bytes (it never unpickles
    # them; torchtitan does, at its load), and the step is committed
    assert ref["stock_error"] == "" and "step-1" in ref["stock_dir"], ref["stock_dir"]


def _check_resumed(run_a: str, report: str, nproc: int, *, logits_tol: float) -> list[dict]:
    ref, tensors = _ref(run_a)
    n = sum(k.startswith(("model/", "optim/")) for k in tensors)
    reports = []
    for r in range(nproc):
        with open(f"{report}.rank{r}.json") as f:
            rep = json.load(f)
        assert rep["loaded"], r
        assert len(rep["differed_before_load"]) == n, "run B starts from other weights and no optimizer state"
        assert rep["missing"] == rep["extra"] == rep["unequal"] == [], (r, rep)
        assert rep["values"] == ref["saved"], r  # train state, lr schedule, param groups, data position
        assert rep["logits_max_diff"] <= logits_tol, (r, rep["logits_max_diff"])
        # one more step: its batch is the one run A drew next, its parameters run A's, bit for bit (AdamW is
        # elementwise and the batch, hence the expert-bias update, is the same on any mesh)
        assert rep["batch3"] == ref["batch3"][str(rep["dp_rank"])], r
        assert rep["step3_unequal"] == [], (r, rep["step3_unequal"])
        assert rep["after_step3"] == ref["after_step3"], r
        reports.append(rep)
    return reports


@pytest.mark.slow
def test_resume_on_another_mesh_then_save(run_a, tmp_path):
    base = str(tmp_path / "b")
    os.makedirs(base)
    _torchrun(2, "load", run_a, "2", "1", "2", str(tmp_path / "report"), base)  # FSDP 2 x TP 1 x EP 2
    reports = _check_resumed(run_a, str(tmp_path / "report"), 2, logits_tol=1e-6)
    assert all(rep["saved_step3"] for rep in reports)
    ckpt = os.path.join(base, "checkpoint", "step-3")
    assert sorted(os.listdir(os.path.join(base, "checkpoint"))) == ["step-3"]
    assert moeckpt.verify(ckpt) == []
    reader = moeckpt.CheckpointReader(ckpt)
    assert reader.index.step == 3 and reader.index.train_state["train_state.step"] == 3
    _, tensors = _ref(run_a)
    for key, want in tensors.items():
        if key.startswith("step3/model/"):
            assert torch.equal(reader.read_tensor(key[len("step3/model/") :]), want), key


@pytest.mark.slow
def test_resume_on_the_same_mesh_is_bit_for_bit(run_a, tmp_path):
    _torchrun(4, "load", run_a, "2", "2", "2", str(tmp_path / "report"))  # torchtitan's resume from its folder
    reports = _check_resumed(run_a, str(tmp_path / "report"), 4, logits_tol=0.0)
    assert all("saved_step3" not in rep for rep in reports)


def test_docs_show_the_tested_manager():
    """docs/library.md's torchtitan code is tests/titan_manager.py's, verbatim (the part after its docstring)."""
    with open(os.path.join(HERE, "titan_manager.py")) as f:
        source = f.read()
    code = source[source.index('"""', 3) + 3 :].strip()
    with open(os.path.join(os.path.dirname(HERE), "docs", "library.md")) as f:
        docs = f.read()
    assert f"```python\n{code}\n```" in docs


def test_the_newest_step_is_the_newest_committed_moeckpt_checkpoint(tmp_path):
    pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan is not installed")
    from ..titan_manager import MoeckptCheckpointManager

    manager = MoeckptCheckpointManager.Config(enable=True, keep_latest_k=0).build(
        dataloader=None,
        model_parts=[torch.nn.Linear(2, 2)],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=str(tmp_path),
    )
    assert manager._find_load_step() == -1  # no folder yet: a fresh start
    folder = tmp_path / "checkpoint"
    moeckpt.save({"w": torch.ones(2)}, str(folder / "step-2"))
    moeckpt.save({"w": torch.ones(2)}, str(folder / "step-10"))
    (folder / "step-30").mkdir()  # a save that did not finish: files, no index
    (folder / "step-30" / "rank-00000.safetensors").write_bytes(b"x")
    (folder / ".step-40.partial").mkdir()
    (folder / "step-50").mkdir()  # torchtitan's own DCP format is not this manager's to load
    (folder / "step-50" / ".metadata").write_bytes(b"")
    assert manager._find_load_step() == 10
    manager.close()


def test_the_dataloader_state_is_json_and_does_not_reshard():
    pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan is not installed")
    from ..titan_workers import JsonStateDataloader, TokenStream

    loader = JsonStateDataloader(TokenStream(1, 2), dp_rank=1, dp_world_size=2, batch_size=2)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    assert set(state) == {"dp_rank_1", "world_size"} and json.loads(state["dp_rank_1"])["dataset_state"] == {
        "sample_idx": 2
    }
    want = next(batches)
    again = JsonStateDataloader(TokenStream(1, 2), dp_rank=1, dp_world_size=2, batch_size=2)
    again.load_state_dict(state)
    assert torch.equal(next(iter(again)), want)  # it goes on where the saved one stood
    again.load_state_dict({"world_size": 2})  # no state for this rank: from the start, as torchtitan's
    other = JsonStateDataloader(TokenStream(0, 1), dp_rank=0, dp_world_size=1, batch_size=2)
    with pytest.raises(ValueError, match="saved at dp 2, loading at dp 1"):
        other.load_state_dict({"dp_rank_0": state["dp_rank_1"], "world_size": 2})
