"""torchtitan's gpt-oss, with its own model code (``pip install --no-deps torchtitan==0.3.0``; see docs/interop.md).

The fixture is torchtitan's tiny gpt-oss (``tests/titan_gptoss_worker.py``: biased fused Q/K/V, sinks, a sliding
window on layer 0, YaRN RoPE, a biased softmax router, biased interleaved experts) parallelized by its own
``parallelize_gptoss`` over 2 gloo ranks (TP 2, EP 2), after two AdamW steps, saved by ``dcp.save`` as its
checkpointer saves. Then:

* ``import-dcp --mapping torchtitan --model config.json`` -> ``export-hf`` -> transformers' ``GptOssForCausalLM``
  loads every tensor (none missing, none unexpected) and gives torchtitan's logits within 1e-6 (fp32; measured
  7.5e-8 on logits up to 0.27). torchtitan's experts cast to bf16 unconditionally, so its forward is taken with
  those casts as identities, and its flex attention runs eagerly, not compiled (inductor on CPU has no log-sum-exp
  output, which the sinks need; torch's eager ``flex_attention`` computes the same): the two then differ in
  operations only (the sinks applied to flex attention's log-sum-exp against an eager softmax with a sink column).
  The exported tensors are bit for bit torchtitan's own ``GptOssStateDictAdapter.to_hf`` output where it maps
  them, and torchtitan's expert matrices transposed where it does not;
* ``import-dcp`` at another layout (TP 2 x DP 3, zarr) -> ``export-dcp`` gives back torchtitan's checkpoint bit for
  bit, and ``dcp.load`` into a fresh torchtitan model reads the same parameters;
* a ``--model`` that does not fit is refused in one line, exit code 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from moeckpt.formats.checkpoint import CheckpointReader

from ..dcp_workers import torchtitan_logits
from ..titan_gptoss_worker import TINY_GPTOSS, hf_gptoss_config_json, torchtitan_gptoss_config
from .test_dcp_frameworks import _hf_files, _torchtitan_model, titan_import_with, titan_round_trip
from .test_dcp_import import _transformers_logits

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERTS = "moe.routed_experts.inner_experts."


@pytest.fixture(scope="module")
def torchtitan_gptoss_dcp(tmp_path_factory) -> str:
    pytest.importorskip("torchtitan.models.gpt_oss", reason="torchtitan is not installed")
    out = str(tmp_path_factory.mktemp("torchtitan-gptoss") / "dcp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--standalone",  # the agent's store on a port of the kernel's choosing (see test_dcp_import.torchrun)
        os.path.join(HERE, "titan_gptoss_worker.py"),
        out,
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return out


@pytest.fixture
def config_json(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_gptoss_config_json()))
    return str(path)


def test_torchtitan_gpt_oss_chain(torchtitan_gptoss_dcp, config_json, tmp_path, moeckpt_cli):
    import transformers
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

    ck, hf = tmp_path / "ck", tmp_path / "hf"
    code, _, err = moeckpt_cli(
        "import-dcp", torchtitan_gptoss_dcp, ck, "--tp", "2", "--ep", "2", "--dp", "2", "--mapping", "torchtitan",
        "--model", config_json,
    )  # fmt: skip
    assert code == 0, err
    assert "expert_bias tensor(s), all zero" in err
    index = CheckpointReader(str(ck)).index
    assert index.model["arch"] == "gpt_oss"
    assert {t.role for t in index.tensors.values()} == {"param", "exp_avg", "exp_avg_sq"}
    assert index.train_state["optimizer"] == {"steps": 2} and index.step == 2
    assert moeckpt_cli("export-hf", ck, hf)[0] == 0
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model = _torchtitan_model(torchtitan_gptoss_dcp, torchtitan_gptoss_config)
    tokens = torch.randint(0, TINY_GPTOSS["vocab"], (2, 16), generator=torch.Generator().manual_seed(3))
    with (
        mock.patch.object(torch.Tensor, "bfloat16", lambda self: self),  # torchtitan's experts, in fp32
        mock.patch.object(FlexAttention, "_compiled_flex_attn", staticmethod(flex_attention)),  # see the docstring
    ):
        want = torchtitan_logits(model, tokens)
    assert want.abs().max() > 0.1  # a model that computes something
    assert (_transformers_logits(str(hf), tokens) - want).abs().max() < 1e-6
    # the exported tensors are bit for bit what torchtitan's own Hugging Face adapter gives, where it maps them:
    # 0.3's maps no expert tensor (its keys are MXFP4 names without the parameters' _EGD suffixes), so those are
    # torchtitan's parameters, the matrices transposed ([E, out, in] -> [E, in, out])
    state = dict(model.state_dict())
    adapter = GptOssStateDictAdapter(torchtitan_gptoss_config(), None).to_hf(state)
    exported = _hf_files(hf)
    experts = {}
    for layer in range(TINY_GPTOSS["n_layers"]):
        tt, pre = f"layers.{layer}.{EXPERTS}", f"model.layers.{layer}.mlp.experts."
        experts[pre + "gate_up_proj"] = state[tt + "mlp1_weight_EGD"].transpose(1, 2)
        experts[pre + "gate_up_proj_bias"] = state[tt + "mlp1_bias_EG"]
        experts[pre + "down_proj"] = state[tt + "mlp2_weight_EDF"].transpose(1, 2)
        experts[pre + "down_proj_bias"] = state[tt + "mlp2_bias_ED"]
    assert not set(adapter) & set(experts) and set(adapter) | set(experts) == set(exported)
    assert all(torch.equal(v, exported[k]) for k, v in {**adapter, **experts}.items())


def test_torchtitan_gpt_oss_round_trip_is_bit_for_bit(torchtitan_gptoss_dcp, config_json, tmp_path, moeckpt_cli):
    layout = ("--tp", "2", "--dp", "3")
    titan_round_trip(torchtitan_gptoss_dcp, config_json, torchtitan_gptoss_config, layout, tmp_path, moeckpt_cli)


@pytest.mark.parametrize(
    "model, what",
    [
        (None, "needs --model"),
        ("qwen3moe-tiny", "names a qwen3_moe model"),
        ({"intermediate_size": 16}, "mlp1_weight_EGD has shape [4, 64, 64]"),
        ({"num_hidden_layers": 1}, "which the --model config does not have"),
    ],
    ids=["no-model", "other-family", "other-shape", "other-layers"],
)
def test_torchtitan_gpt_oss_refuses_a_config_that_does_not_fit(
    torchtitan_gptoss_dcp, tmp_path, moeckpt_cli, model, what
):
    code, out, err = titan_import_with(torchtitan_gptoss_dcp, hf_gptoss_config_json(), model, tmp_path, moeckpt_cli)
    assert code == 2 and what in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (out, err)
    assert not (tmp_path / "ck").exists()


def test_a_transposed_slot_reads_each_row_transposed(tmp_path):
    """What moves the expert matrices: a slot with ``transpose`` fills the target's box with its last two dims
    swapped, any rows of it read alone; a chunk cut along those dims cannot be (a row would not be one run)."""
    import warnings
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp

    from moeckpt.formats.box import Box
    from moeckpt.formats.dcp import DcpFormatError, open_dcp
    from moeckpt.reshard.dcp_source import DcpPieceReader, Slot, virtual_pieces

    w = torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5)  # [E, out, in]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dcp.save in one process, without a process group
        dcp.save({"w": w}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    d = open_dcp(str(tmp_path / "d"))
    index = SimpleNamespace(tensors={"t": SimpleNamespace(shape=(3, 5, 4), dtype="float32")})
    refs, transposed = virtual_pieces(
        d.chunks(["w"]), [Slot("w", Box.full(w.shape), "t", (0, 0, 0), transpose=True)], index
    )
    assert [r.box for r in refs] == [Box.full((3, 5, 4))] and len(transposed) == 1
    reader = DcpPieceReader(d, index, transposed)
    assert reader.map_rows(refs[0], 0, 3) is None  # read and reordered, never mapped
    assert torch.equal(reader.read_rows(refs[0], 0, 3), w.transpose(1, 2))
    assert torch.equal(reader.read_rows(refs[0], 1, 3), w[1:].transpose(1, 2))
    half = Slot("w", Box((0, 0, 0), (3, 4, 2)), "t", (0, 0, 0), transpose=True)
    with pytest.raises(DcpFormatError, match="cannot be read transposed"):
        virtual_pieces(d.chunks(["w"]), [half], index)
    with pytest.raises(ValueError, match="three or more"):
        Slot("w", Box.full((4, 5)), "t", (0, 0), transpose=True)


def test_transposed_chunks_cut_along_the_matrix_dims_land_in_place():
    """A TP-sharded expert matrix is stored as chunks cut along its out or in dim, each chunk C-ordered on its own:
    each is read whole, transposed, and fills its own box of the target."""
    from types import SimpleNamespace

    from moeckpt.formats.box import Box
    from moeckpt.formats.dcp.reader import StoredChunk
    from moeckpt.reshard.dcp_source import DcpPieceReader, Slot, virtual_pieces

    w = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6)  # [E, out, in]
    for dim in (1, 2):  # mlp1 is split along out (S(1)), mlp2 along in (S(2))
        halves = torch.chunk(w, 2, dim=dim)
        blob, chunks, at = b"", [], 0
        for i, h in enumerate(halves):
            data = h.contiguous().numpy().tobytes()
            offsets = tuple(i * h.shape[d] if d == dim else 0 for d in range(3))
            chunks.append(StoredChunk("w", Box(offsets, tuple(h.shape)), "float32", "f", at, len(data)))
            blob, at = blob + data, at + len(data)

        def read_into(file, start, out, blob=blob):
            out.view(-1).copy_(torch.frombuffer(bytearray(blob[start : start + out.numel() * 4]), dtype=torch.float32))

        index = SimpleNamespace(tensors={"t": SimpleNamespace(shape=(2, 6, 4), dtype="float32")})
        slot = Slot("w", Box.full(w.shape), "t", (0, 0, 0), transpose=True)
        refs, transposed = virtual_pieces({"w": chunks}, [slot], index)
        reader = DcpPieceReader(
            SimpleNamespace(
                read_into=read_into, storage=SimpleNamespace(is_local=False, fork_safe=False), location="mem"
            ),
            index,
            transposed,
        )
        got = torch.full((2, 6, 4), float("nan"))
        for ref in refs:
            got[ref.box.slices()] = reader.read_rows(ref, 0, ref.box.shape[0])
        assert torch.equal(got, w.transpose(1, 2)), dim
