"""The chains with the real frameworks, where they are installed (``pip install --no-deps torchtitan==0.3.0``,
``megatron-core==0.16.1``; see docs/interop.md): their own model code and checkpoint writers, their own forward.

* torchtitan: its Qwen3-MoE parallelized by its own ``parallelize_qwen3`` over 4 gloo ranks (FSDP2 x TP x EP
  DTensors), saved with its state layout; ``import-dcp --mapping torchtitan`` -> ``export-hf`` -> transformers
  gives torchtitan's logits within 1e-5 (fp32; torchtitan's experts cast to bf16 unconditionally, so its forward is
  taken with those casts as identities); ``export-dcp`` gives back its checkpoint bit for bit, and ``dcp.load``
  into a fresh torchtitan model reads it.
* torchtitan DeepSeek-V3: its own model (MLA with q_lora, a dense layer, a MoE layer with a shared expert,
  group-limited sigmoid routing and a trained ``expert_bias_E``) parallelized by ``parallelize_deepseekv3`` over 2
  ranks (TP 2, EP 2); the same chain, with ``--model`` its Hugging Face config.json. transformers' logits equal
  torchtitan's within 2e-4 (fp32, logits up to ~3: measured 5.4e-5; the two use different operations,
  complex-multiply RoPE against rotate-half and flex attention against sdpa, and the difference grows by layer from
  6e-6 after the first attention; see docs/interop.md); the exported weights are bit for bit what torchtitan's own
  adapter gives.
* Megatron-Core: its GPTModel with MoE layers saved by ``dist_checkpointing.save`` (torch_dist);
  ``import-dcp --mapping megatron`` -> ``export-hf`` -> transformers gives Megatron's own logits within 1e-5;
  the same model without q/k layer norms is a Mixtral: ``--mapping megatron --model`` its config.json gives
  ``mixtral``, and transformers' MixtralForCausalLM Megatron's logits within 1e-5. Megatron's GPTModel as
  DeepSeek-V3 (``MLATransformerConfig``, the local spec with two shims for its latent attention, see
  ``dcp_workers.write_megatron_dsv3``) gives ``deepseek_v3``, and transformers' DeepseekV3ForCausalLM Megatron's
  logits within 2e-4 (measured 4.6e-5 on logits up to 1.5, as torchtitan's DeepSeek-V3 above).
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.dcp import open_dcp

from ..dcp_workers import (
    TINY,
    TINY_DSV3,
    hf_config_json,
    hf_dsv3_config_json,
    hf_mixtral_config_json,
    torchtitan_config,
    torchtitan_dsv3_config,
    torchtitan_logits,
)
from .test_dcp_import import _transformers_logits, torchrun

pytestmark = pytest.mark.slow


def _model_json(tmp_path) -> str:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(hf_config_json()))
    return str(path)


@pytest.fixture(scope="module")
def torchtitan_dcp(tmp_path_factory) -> str:
    pytest.importorskip("torchtitan.models.qwen3", reason="torchtitan is not installed")
    out = str(tmp_path_factory.mktemp("torchtitan") / "dcp")
    torchrun("torchtitan", out, 4)
    return out


def _torchtitan_model(dcp_dir: str, config=torchtitan_config):
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        model = config().build()
    model = model.to_empty(device="cpu")
    model.init_weights()
    sd = model.state_dict()  # wq/wk/wv split from the fused wqkv by torchtitan's own state-dict hook
    dcp.load(sd, checkpoint_id=dcp_dir, no_dist=True)
    model.load_state_dict(sd)  # and merged back by its load hook
    return model.eval()


def test_torchtitan_chain(torchtitan_dcp, tmp_path, moeckpt_cli):
    ck, hf = tmp_path / "ck", tmp_path / "hf"
    code, _, err = moeckpt_cli(
        "import-dcp",
        torchtitan_dcp,
        ck,
        "--tp",
        "2",
        "--ep",
        "2",
        "--dp",
        "2",
        "--mapping",
        "torchtitan",
        "--model",
        _model_json(tmp_path),
    )
    assert code == 0, err
    index = CheckpointReader(str(ck)).index
    assert {t.role for t in index.tensors.values()} == {"param", "exp_avg", "exp_avg_sq"}
    assert index.train_state["optimizer"] == {"steps": 2} and index.step == 2
    assert moeckpt_cli("export-hf", ck, hf)[0] == 0
    model = _torchtitan_model(torchtitan_dcp)
    tokens = torch.randint(0, TINY["vocab"], (2, 16), generator=torch.Generator().manual_seed(3))
    with mock.patch.object(torch.Tensor, "bfloat16", lambda self: self):  # torchtitan's experts, in fp32
        want = torchtitan_logits(model, tokens)
    assert (_transformers_logits(str(hf), tokens) - want).abs().max() < 1e-5
    # the mapped weights are exactly what torchtitan's own Hugging Face adapter gives
    from safetensors.torch import load_file
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    adapter = Qwen3StateDictAdapter(torchtitan_config(), None).to_hf(dict(model.state_dict()))
    exported = {}
    for f in os.listdir(hf):
        if f.endswith(".safetensors"):
            exported.update(load_file(str(hf / f)))
    assert set(adapter) == set(exported)
    assert all(torch.equal(adapter[k], exported[k]) for k in adapter)


def test_torchtitan_round_trip_is_bit_for_bit(torchtitan_dcp, tmp_path, moeckpt_cli):
    ck, back = tmp_path / "ck", tmp_path / "back"
    assert (
        moeckpt_cli(
            "import-dcp",
            torchtitan_dcp,
            ck,
            "--tp",
            "2",
            "--dp",
            "3",
            "--mapping",
            "torchtitan",
            "--model",
            _model_json(tmp_path),
            "--format",
            "zarr",
        )[0]
        == 0
    )
    code, _, err = moeckpt_cli("export-dcp", ck, back)  # torchtitan names: the default for qwen3_moe
    assert code == 0, err
    a, b = open_dcp(torchtitan_dcp), open_dcp(str(back))
    assert set(a.tensors) == set(b.tensors) and set(a.values) == set(b.values)
    for name in a.tensors:
        x, y = a.read_tensor(name), b.read_tensor(name)
        assert x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (
            name
        )
    assert all(a.read_value(k) == b.read_value(k) for k in a.values)
    # what torchtitan reads: dcp.load into its model gives the same parameters
    original, again = _torchtitan_model(torchtitan_dcp), _torchtitan_model(str(back))
    for (k, p), (_, q) in zip(original.state_dict().items(), again.state_dict().items()):
        assert torch.equal(p, q), k


@pytest.fixture(scope="module")
def torchtitan_dsv3_dcp(tmp_path_factory) -> str:
    pytest.importorskip("torchtitan.models.deepseek_v3", reason="torchtitan is not installed")
    out = str(tmp_path_factory.mktemp("torchtitan-dsv3") / "dcp")
    torchrun("torchtitan-dsv3", out, 2)
    return out


def _hf_files(hf) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in os.listdir(hf):
        if f.endswith(".safetensors"):
            out.update(load_file(str(hf / f)))
    return out


def test_torchtitan_deepseek_v3_chain(torchtitan_dsv3_dcp, tmp_path, moeckpt_cli):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_dsv3_config_json()))
    ck, hf = tmp_path / "ck", tmp_path / "hf"
    code, _, err = moeckpt_cli(
        "import-dcp", torchtitan_dsv3_dcp, ck, "--tp", "2", "--ep", "2", "--dp", "2", "--mapping", "torchtitan",
        "--model", config,
    )  # fmt: skip
    assert code == 0, err
    index = CheckpointReader(str(ck)).index
    assert index.model["arch"] == "deepseek_v3"
    assert {t.role for t in index.tensors.values()} == {"param", "exp_avg", "exp_avg_sq"}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bias in index.tensors and f"exp_avg/{bias}" not in index.tensors  # a buffer: no optimizer state
    assert index.train_state["optimizer"] == {"steps": 2} and index.step == 2
    assert moeckpt_cli("export-hf", ck, hf)[0] == 0
    model = _torchtitan_model(torchtitan_dsv3_dcp, torchtitan_dsv3_config)
    assert torch.count_nonzero(model.layers["1"].moe.expert_bias_E) > 0  # a trained bias: routing depends on it
    tokens = torch.randint(0, TINY_DSV3["vocab"], (2, 16), generator=torch.Generator().manual_seed(3))
    with mock.patch.object(torch.Tensor, "bfloat16", lambda self: self):  # torchtitan's experts, in fp32
        want = torchtitan_logits(model, tokens)
    assert (_transformers_logits(str(hf), tokens) - want).abs().max() < 2e-4
    # the mapped weights are exactly what torchtitan's own Hugging Face adapter gives
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    adapter = DeepSeekV3StateDictAdapter(torchtitan_dsv3_config(), None).to_hf(dict(model.state_dict()))
    exported = _hf_files(hf)
    assert set(adapter) == set(exported)
    assert all(torch.equal(adapter[k], exported[k]) for k in adapter)


def test_torchtitan_deepseek_v3_round_trip_is_bit_for_bit(torchtitan_dsv3_dcp, tmp_path, moeckpt_cli):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_dsv3_config_json()))
    titan_round_trip(
        torchtitan_dsv3_dcp, config, torchtitan_dsv3_config, ("--tp", "4", "--dp", "3"), tmp_path, moeckpt_cli
    )


def titan_round_trip(dcp_dir: str, config, titan_config, layout: tuple[str, ...], tmp_path, moeckpt_cli) -> None:
    """A torchtitan checkpoint imported at ``layout`` (zarr) and exported back under torchtitan's names (the default
    for its family) is the same DCP checkpoint bit for bit, and torchtitan's model loads equal parameters from it."""
    ck, back = tmp_path / "ck", tmp_path / "back"
    code, _, err = moeckpt_cli(
        "import-dcp", dcp_dir, ck, *layout, "--mapping", "torchtitan", "--model", config, "--format", "zarr"
    )
    assert code == 0, err
    code, _, err = moeckpt_cli("export-dcp", ck, back)
    assert code == 0, err
    _same_dcp(dcp_dir, str(back))
    original = _torchtitan_model(dcp_dir, titan_config)
    again = _torchtitan_model(str(back), titan_config)
    for (k, p), (_, q) in zip(original.state_dict().items(), again.state_dict().items()):
        assert torch.equal(p, q), k


@pytest.mark.parametrize(
    "model, what",
    [
        (None, "needs --model"),
        ("qwen3moe-tiny", "names a qwen3_moe model"),
        ({"kv_lora_rank": 8}, "kv_b_proj.weight the shape [128, 8]"),
        ({"first_k_dense_replace": 0}, "which the --model config does not have"),
    ],
    ids=["no-model", "other-family", "other-shape", "other-dense-layers"],
)
def test_torchtitan_deepseek_v3_refuses_a_config_that_does_not_fit(
    torchtitan_dsv3_dcp, tmp_path, moeckpt_cli, model, what
):
    code, out, err = titan_import_with(torchtitan_dsv3_dcp, hf_dsv3_config_json(), model, tmp_path, moeckpt_cli)
    assert code == 2 and what in err and "Traceback" not in err, (out, err)
    assert not (tmp_path / "ck").exists()


def titan_import_with(dcp_dir: str, hf_config: dict, model, tmp_path, moeckpt_cli) -> tuple[int, str, str]:
    """``import-dcp --mapping torchtitan`` of ``dcp_dir`` into ``tmp_path/ck`` with ``--model``: none (``None``), a
    preset (a str), or ``hf_config`` with the fields of ``model`` (a dict) changed."""
    args = []
    if isinstance(model, str):
        args = ["--model", model]
    elif model is not None:
        config = tmp_path / "config.json"
        config.write_text(json.dumps({**hf_config, **model}))
        args = ["--model", str(config)]
    return moeckpt_cli("import-dcp", dcp_dir, tmp_path / "ck", "--mapping", "torchtitan", *args)


def _same_dcp(a_dir: str, b_dir: str) -> None:
    """Two DCP checkpoints hold the same tensors (bit for bit) and values."""
    a, b = open_dcp(a_dir), open_dcp(b_dir)
    assert set(a.tensors) == set(b.tensors) and set(a.values) == set(b.values)
    for name in a.tensors:
        x, y = a.read_tensor(name), b.read_tensor(name)
        assert x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), (
            name
        )
    assert all(a.read_value(k) == b.read_value(k) for k in a.values)


@pytest.fixture(scope="module")
def megatron_dcp(tmp_path_factory) -> str:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pytest.importorskip("psutil", reason="megatron-core's saver needs psutil")
    out = str(tmp_path_factory.mktemp("megatron") / "dcp")
    torchrun("megatron", out, 1)
    return out


def test_megatron_chain(megatron_dcp, tmp_path, moeckpt_cli):
    from safetensors.torch import load_file

    ck, hf = tmp_path / "ck", tmp_path / "hf"
    code, _, err = moeckpt_cli(
        "import-dcp",
        megatron_dcp,
        ck,
        "--tp",
        "2",
        "--ep",
        "2",
        "--dp",
        "2",
        "--mapping",
        "megatron",
        "--model",
        _model_json(tmp_path),
    )
    assert code == 0, err
    assert moeckpt_cli("verify", ck)[0] == 0
    assert moeckpt_cli("export-hf", ck, hf)[0] == 0
    ref = load_file(megatron_dcp + ".logits.safetensors")
    assert (_transformers_logits(str(hf), ref["tokens"]) - ref["logits"]).abs().max() < 1e-5


@pytest.fixture(scope="module")
def megatron_families(tmp_path_factory) -> str:
    """Megatron's Mixtral at ``<dir>.mixtral`` and its DeepSeek-V3 at ``<dir>.dsv3``, written by one torchrun."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pytest.importorskip("psutil", reason="megatron-core's saver needs psutil")
    out = str(tmp_path_factory.mktemp("megatron-families") / "dcp")
    torchrun("megatron-families", out, 1)
    return out


@pytest.fixture(scope="module")
def megatron_mixtral_dcp(megatron_families) -> str:
    return megatron_families + ".mixtral"


@pytest.fixture(scope="module")
def megatron_dsv3_dcp(megatron_families) -> str:
    return megatron_families + ".dsv3"


def test_megatron_mixtral_chain(megatron_mixtral_dcp, tmp_path, moeckpt_cli):
    from safetensors.torch import load_file

    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_mixtral_config_json()))
    ck, hf = tmp_path / "ck", tmp_path / "hf"
    code, _, err = moeckpt_cli(
        "import-dcp", megatron_mixtral_dcp, ck, "--tp", "2", "--ep", "2", "--dp", "2", "--mapping", "megatron",
        "--model", config,
    )  # fmt: skip
    assert code == 0, err
    assert CheckpointReader(str(ck)).index.model["arch"] == "mixtral"
    assert moeckpt_cli("verify", ck)[0] == 0
    assert moeckpt_cli("export-hf", ck, hf)[0] == 0
    assert json.loads((hf / "config.json").read_text())["model_type"] == "mixtral"
    ref = load_file(megatron_mixtral_dcp + ".logits.safetensors")
    assert (_transformers_logits(str(hf), ref["tokens"]) - ref["logits"]).abs().max() < 1e-5


@pytest.mark.parametrize(
    "model, what",
    [
        (None, "needs --model"),
        ({"head_dim": 8}, "which does not fit"),
        ({"intermediate_size": 64}, "gate_up_proj (shape [4, 128, 64]) is not filled exactly"),
        ({"num_hidden_layers": 3}, "num_hidden_layers=3"),
    ],
    ids=["no-model", "other-head-dim", "larger-experts", "other-layers"],
)
def test_megatron_mixtral_refuses_a_config_that_does_not_fit(megatron_mixtral_dcp, tmp_path, moeckpt_cli, model, what):
    args = []
    if model is not None:
        config = tmp_path / "config.json"
        config.write_text(json.dumps({**hf_mixtral_config_json(), **model}))
        args = ["--model", str(config)]
    code, out, err = moeckpt_cli("import-dcp", megatron_mixtral_dcp, tmp_path / "ck", "--mapping", "megatron", *args)
    assert code == 2 and what in err and "Traceback" not in err, (out, err)


def test_megatron_deepseek_v3_chain(megatron_dsv3_dcp, tmp_path, moeckpt_cli):
    from safetensors.torch import load_file

    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_dsv3_config_json()))
    code, _, err = moeckpt_cli("import-dcp", megatron_dsv3_dcp, tmp_path / "x", "--mapping", "megatron")
    assert code == 2 and "needs --model" in err, err
    ck, hf = tmp_path / "ck", tmp_path / "hf"
    code, _, err = moeckpt_cli(
        "import-dcp", megatron_dsv3_dcp, ck, "--tp", "2", "--ep", "2", "--dp", "2", "--mapping", "megatron",
        "--model", config,
    )  # fmt: skip
    assert code == 0, err
    index = CheckpointReader(str(ck)).index
    assert index.model["arch"] == "deepseek_v3"
    bias = CheckpointReader(str(ck)).read_box(
        "model.layers.1.mlp.gate.e_score_correction_bias", Box.full((TINY_DSV3["experts"],))
    )
    assert torch.count_nonzero(bias) > 0  # Megatron's trained expert_bias, kept as the correction bias
    assert moeckpt_cli("export-hf", ck, hf)[0] == 0
    ref = load_file(megatron_dsv3_dcp + ".logits.safetensors")
    assert (_transformers_logits(str(hf), ref["tokens"]) - ref["logits"]).abs().max() < 2e-4
