"""A state-dict checkpoint of another trainer, under a bundled model's Hugging Face names: `train --init-from` and
`export-hf --model` use it as that model (issue 19, item 4)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import moeckpt
from moeckpt.formats.checkpoint import CheckpointReader


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """A qwen3moe-tiny checkpoint of the bundled trainer, and the same weights (plus AdamW moments) saved by
    ``moeckpt.save`` as another trainer would: ``{"model": params, "optim": {"state": {name: moments}}}``."""
    from moeckpt.cli.main import cli

    root = tmp_path_factory.mktemp("as-model")
    ours = str(root / "ours")
    cli.main(
        ["init", ours, "--model", "qwen3moe-tiny", "--with-optimizer", "--tp", "2", "--dp", "2"], standalone_mode=False
    )
    reader = CheckpointReader(ours)
    params = {n: reader.read_tensor(n) for n, e in reader.index.tensors.items() if e.role == "param"}
    moments = {n: {r: reader.read_tensor(f"{r}/{n}") for r in ("exp_avg", "exp_avg_sq")} for n in params}
    lib = str(root / "lib")
    moeckpt.save({"model": params, "optim": {"state": moments}, "step": 7}, lib)
    return ours, lib, params


def test_export_hf_of_a_state_dict_with_model_equals_the_bundled_export(bundled, tmp_path, moeckpt_cli):
    ours, lib, _ = bundled
    code, _, err = moeckpt_cli("export-hf", lib, tmp_path / "hf-lib")
    assert code == 2 and "pass --model" in err  # a state dict names no model
    assert moeckpt_cli("export-hf", lib, tmp_path / "hf-lib", "--model", "qwen3moe-tiny")[0] == 0
    assert moeckpt_cli("export-hf", ours, tmp_path / "hf-ours")[0] == 0
    files = sorted(f for f in os.listdir(tmp_path / "hf-ours") if f.endswith(".safetensors"))
    assert files == sorted(f for f in os.listdir(tmp_path / "hf-lib") if f.endswith(".safetensors"))
    for f in files:
        a, b = load_file(str(tmp_path / "hf-ours" / f)), load_file(str(tmp_path / "hf-lib" / f))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(tmp_path / "hf-ours" / "config.json")) == json.load(open(tmp_path / "hf-lib" / "config.json"))


@pytest.mark.slow
def test_train_init_from_a_state_dict_starts_from_its_weights_and_moments(bundled, tmp_path, moeckpt_cli):
    ours, lib, _ = bundled
    common = [
        "--model",
        "qwen3moe-tiny",
        "--steps",
        "2",
        "--seq-len",
        "16",
        "--global-batch",
        "4",
        "--cpu",
        "--warmup-steps",
        "0",
    ]
    code, _, err = moeckpt_cli("train", "--init-from", lib, "--run-dir", tmp_path / "a", *common)
    assert code == 0, err
    code, _, err = moeckpt_cli("train", "--init-from", ours, "--run-dir", tmp_path / "b", *common)
    assert code == 0, err
    losses = [
        [json.loads(line)["loss"] for line in open(tmp_path / run / "metrics.jsonl") if '"loss"' in line]
        for run in ("a", "b")
    ]
    assert losses[0] == losses[1]  # the same weights and moments: the same steps, bit for bit
    code, _, err = moeckpt_cli("train", "--init-from", lib, "--run-dir", tmp_path / "c", *common[2:])
    assert code == 2 and "pass --model" in err
