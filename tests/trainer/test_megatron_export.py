"""``export-dcp --mapping megatron`` against Megatron-Core itself (``megatron-core==0.16.1``, see docs/interop.md).

For each family the Megatron import maps (Qwen3-MoE, Mixtral, DeepSeek-V3): Megatron's GPTModel writes its
checkpoint (the fixtures of :mod:`.test_dcp_frameworks`), ``import-dcp --mapping megatron`` reads it into a moeckpt
layout (another per family), ``export-dcp --mapping megatron`` writes it back, and Megatron's own
``dist_checkpointing.load`` reads the export into a fresh GPTModel of the writer's config (every value NaN before
the load) in one torchrun worker for the three, at TP 1 and at TP 2 x EP 2: its parameters and buffers are bit for
bit those Megatron loads from its own checkpoint at the same layout, its logits those of that model, and at TP 1
the writer's, exactly (within 1e-5 at TP 2, whose reductions run in another order).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from unittest import mock

import pytest
import torch

from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.dcp import open_dcp

from ..dcp_workers import hf_config_json, hf_dsv3_config_json, hf_mixtral_config_json
from .test_dcp_frameworks import (  # noqa: F401  (module fixtures: Megatron writes its checkpoints)
    megatron_dcp,
    megatron_dsv3_dcp,
    megatron_families,
    megatron_mixtral_dcp,
)
from .test_dcp_import import torchrun_worker

#: the load worker's world: Megatron's TP 2 x EP 2 layout needs two ranks (its TP 1 layout is then DP 2)
RANKS = 2

#: family -> (the moeckpt layout and format it is imported at, its --model config)
CASES = {
    "qwen3_moe": (["--tp", "2", "--ep", "2", "--dp", "2"], hf_config_json),
    "mixtral": (["--tp", "1", "--ep", "2", "--dp", "4", "--format", "zarr"], hf_mixtral_config_json),
    "deepseek_v3": (["--tp", "2", "--dp", "3"], hf_dsv3_config_json),
}


def _cli(*args) -> tuple[int, str, str]:
    """``moeckpt ARGS`` in-process, as the console script runs it (the module fixture cannot take the
    function-scoped ``moeckpt_cli``)."""
    from moeckpt.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", ["moeckpt", *map(str, args)]):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def megatron_exports(tmp_path_factory, request) -> dict:
    """Each family's chain through the CLI, then one torchrun worker loading the three exports into Megatron."""
    root = tmp_path_factory.mktemp("megatron-export")
    # by name, not as parameters: the imported fixtures would be shadowed by the parameters of the same name
    names = {"qwen3_moe": "megatron_dcp", "mixtral": "megatron_mixtral_dcp", "deepseek_v3": "megatron_dsv3_dcp"}
    originals = {family: request.getfixturevalue(name) for family, name in names.items()}
    chains: dict = {}
    for family, (layout, config) in CASES.items():
        model = root / f"{family}.json"
        model.write_text(json.dumps(config()))
        ck, out = root / f"{family}.ck", root / f"{family}.megatron"
        chains[family] = {
            "original": originals[family],
            "exported": str(out),
            "import": _cli("import-dcp", originals[family], ck, *layout, "--mapping", "megatron", "--model", model),
            "export": _cli("export-dcp", ck, out, "--mapping", "megatron"),
        }
    spec = root / "spec.json"
    spec.write_text(json.dumps([{"family": f, "exported": c["exported"], "original": c["original"]} for f, c in
                                chains.items() if c["export"][0] == 0]))  # fmt: skip
    result = root / "loaded.json"
    torchrun_worker("megatron_load_worker.py", str(spec), str(result), nproc=RANKS)
    by_rank = [json.loads((root / f"loaded.json.{r}").read_text()) for r in range(RANKS)]
    for family, chain in chains.items():
        chain["loaded"] = {
            key.split("@")[1]: [got[key] for got in by_rank] for key in by_rank[0] if key.startswith(f"{family}@")
        }
    return chains


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_megatron_loads_the_export_bit_for_bit(megatron_exports, family):
    from safetensors.torch import load_file

    chain = megatron_exports[family]
    for step in ("import", "export"):
        code, _, err = chain[step]
        assert code == 0, (step, err)
    # the export holds exactly the keys Megatron's own save wrote (tensors and _extra_state objects), same bits
    mine, theirs = open_dcp(chain["exported"]), open_dcp(chain["original"])
    assert set(mine.tensors) == set(theirs.tensors) and set(mine.values) == set(theirs.values)
    for name in theirs.tensors:
        a, b = theirs.read_tensor(name), mine.read_tensor(name)
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    assert torch.load(os.path.join(chain["exported"], "common.pt"), weights_only=True) == {}
    # and Megatron's dist_checkpointing.load reads it into its GPTModel, at TP 1 and resharded to TP 2 x EP 2
    assert set(chain["loaded"]) == {"tp1ep1", "tp2ep2"}, chain["loaded"].keys()
    want = load_file(chain["original"] + ".logits.safetensors")["logits"]
    for layout, ranks in chain["loaded"].items():
        for rank, got in enumerate(ranks):
            where = (layout, rank)
            assert got["compared"] > 20 and got["missing"] == [] and got["differ"] == [], (where, got)
            assert got["same_logits"], where  # the same forward as from Megatron's own checkpoint, bit for bit
            logits = torch.tensor(got["logits"], dtype=want.dtype)
            if layout == "tp1ep1":
                assert torch.equal(logits, want), where  # the writer's own logits, exactly
            else:  # the rank's half of the vocabulary; TP 2 sums in another order than the writer's TP 1
                part = want.shape[-1] // 2
                assert (logits - want[..., rank * part : (rank + 1) * part]).abs().max() < 1e-5, where


def test_export_refuses_a_family_megatron_has_not(tmp_path, moeckpt_cli):
    ck = tmp_path / "zaya"
    assert moeckpt_cli("init", ck, "--model", "zaya-tiny", "--tp", "1", "--ep", "1", "--dp", "1")[0] == 0
    code, out, err = moeckpt_cli("export-dcp", ck, tmp_path / "out", "--mapping", "megatron")
    assert code == 2 and "Traceback" not in err, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "'zaya'" in lines[0] and "qwen3_moe, mixtral, deepseek_v3" in lines[0], err
    assert not (tmp_path / "out").exists()


#: the plans a round trip without Megatron covers: (preset, config fields changed, parameter dtype)
ROUND_TRIPS = {
    "qwen3_moe": ("qwen3moe-tiny", {}, "fp32"),
    "qwen3_moe-tied": ("qwen3moe-tiny", {"tie_word_embeddings": True}, "fp32"),
    "mixtral-bf16": ("mixtral-tiny", {}, "bf16"),
    "deepseek_v3": ("deepseekv3-tiny", {}, "fp32"),
    "deepseek_v3-no-q-lora": ("deepseekv3-tiny", {"q_lora_rank": None}, "bf16"),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_export_without_megatron_round_trips_and_says_the_optimizer_is_left_out(tmp_path, moeckpt_cli, case):
    """Export then the Megatron import gives the checkpoint back (no Megatron needed); the AdamW moments are not
    written, with a note that says so."""
    from moeckpt.trainer.models import presets

    preset, fields, dtype = ROUND_TRIPS[case]
    doc = presets()[preset].to_json()
    doc["config"].update(fields)
    model = tmp_path / "model.json"
    model.write_text(json.dumps(doc))
    ck, out, back = tmp_path / "ck", tmp_path / "megatron", tmp_path / "back"
    init = ("init", ck, "--model", model, "--tp", "2", "--ep", "2", "--dp", "2", "--dtype", dtype, "--with-optimizer")
    assert moeckpt_cli(*init)[0] == 0
    code, _, err = moeckpt_cli("export-dcp", ck, out, "--mapping", "megatron")
    assert code == 0 and "note: optimizer state (exp_avg, exp_avg_sq" in err, err
    assert json.loads((out / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    dcp = open_dcp(str(out))
    assert ("output_layer.weight" in dcp.tensors) != bool(fields.get("tie_word_embeddings"))
    code, _, err = moeckpt_cli(
        "import-dcp", out, back, "--tp", "1", "--dp", "1", "--mapping", "megatron", "--model", model
    )
    assert code == 0, err
    a, b = CheckpointReader(str(ck)), CheckpointReader(str(back))
    params = {n for n, t in a.index.tensors.items() if t.role == "param"}
    assert set(b.index.tensors) == params and b.index.model == a.index.model
    for name in params:
        box = Box.full(a.index.tensors[name].shape)
        x, y = a.read_box(name, box), b.read_box(name, box)
        assert x.dtype == y.dtype and torch.equal(x, y), name
