"""The chains with the real frameworks, where they are installed (``pip install --no-deps torchtitan==0.3.0``,
``megatron-core==0.16.1``; see docs/interop.md): their own model code and checkpoint writers, their own forward.

* torchtitan: its Qwen3-MoE parallelized by its own ``parallelize_qwen3`` over 4 gloo ranks (FSDP2 x TP x EP
  DTensors), saved with its state layout; ``import-dcp --mapping torchtitan`` -> ``export-hf`` -> transformers
  gives torchtitan's logits within 1e-5 (fp32; torchtitan's experts cast to bf16 unconditionally, so its forward is
  taken with those casts as identities); ``export-dcp`` gives back its checkpoint bit for bit, and ``dcp.load``
  into a fresh torchtitan model reads it.
* Megatron-Core: its GPTModel with MoE layers saved by ``dist_checkpointing.save`` (torch_dist);
  ``import-dcp --mapping megatron`` -> ``export-hf`` -> transformers gives Megatron's own logits within 1e-5.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.dcp import open_dcp

from ..dcp_workers import TINY, hf_config_json, torchtitan_config, torchtitan_logits
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


def _torchtitan_model(dcp_dir: str):
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        model = torchtitan_config().build()
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
