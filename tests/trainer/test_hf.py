"""Hugging Face export and import, proven by transformers itself.

Checkpoints come from ``moeckpt init`` in several layouts and formats; exports are loaded with
``AutoModelForCausalLM.from_pretrained`` and compared with our module on the checkpoint's own weights.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.index import INDEX_NAME
from moeckpt.trainer.models import ModelSpec
from moeckpt.trainer.models.layers import build_model

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402  (installed with transformers)

TINY = ["zaya-tiny", "qwen3moe-tiny"]


def _init(cli, out, preset, tp, ep, dp, *extra):
    code, _, err = cli("init", out, "--model", preset, "--tp", tp, "--ep", ep, "--dp", dp, *extra)
    assert code == 0, err
    return out


def _export(cli, ckpt, out, *extra):
    code, stdout, err = cli("export-hf", ckpt, out, *extra)
    assert code == 0, err
    return out


def _files(directory) -> dict[str, bytes]:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def _ours(ckpt) -> torch.nn.Module:
    reader = CheckpointReader(str(ckpt))
    model = build_model(ModelSpec.from_json(reader.index.model))
    model.load_state_dict({k: reader.read_tensor(k).float() for k in model.state_dict()})
    return model.eval()


def _from_pretrained(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), output_loading_info=True, dtype=torch.float32
    )
    return model.eval(), info


def test_export_is_identical_from_every_layout_and_format(tmp_path, moeckpt_cli):
    exports = []
    remote = f"memory://moeckpt-tests/hf-{os.getpid()}/ck"  # any fsspec storage, read by byte ranges
    sources = [
        (1, 1, 1, "safetensors", tmp_path / "ck0"),
        (2, 2, 2, "safetensors", tmp_path / "ck1"),
        (2, 1, 2, "zarr", tmp_path / "ck2"),
        (1, 2, 4, "safetensors", remote),
    ]
    for i, (tp, ep, dp, fmt, where) in enumerate(sources):
        ckpt = _init(moeckpt_cli, where, "zaya-tiny", tp, ep, dp, "--format", fmt)
        exports.append(_files(_export(moeckpt_cli, ckpt, tmp_path / f"hf{i}", "--max-shard-size", "150KB")))
    assert len([n for n in exports[0] if n.endswith(".safetensors")]) > 1  # really sharded
    assert all(e == exports[0] for e in exports[1:])


@pytest.mark.parametrize("preset", TINY)
def test_transformers_loads_export_with_same_logits(tmp_path, moeckpt_cli, preset):
    ckpt = _init(moeckpt_cli, tmp_path / "ck", preset, 2, 2, 2)
    out = _export(moeckpt_cli, ckpt, tmp_path / "hf", "--dtype", "fp32", "--max-shard-size", "100KB")
    hf, info = _from_pretrained(out)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    ours = _ours(ckpt)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-5)
        # the loss our trainer reports on the checkpoint is the loss transformers computes on the export
        torch.testing.assert_close(ours.loss(ids), hf(ids, labels=ids).loss, rtol=0, atol=1e-5)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    data_bytes = 0
    for name in shards:
        raw = (out / name).read_bytes()
        (hlen,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + hlen])
        assert header["__metadata__"] == {"format": "pt"}
        data_bytes += len(raw) - 8 - hlen
    assert index["metadata"]["total_size"] == data_bytes
    assert (out / "generation_config.json").exists()
    # byte-level vocabularies have no special tokens: no ids that would stop generation at a letter
    assert "eos_token_id" not in json.loads((out / "generation_config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    if preset.startswith("qwen3"):
        # transformers 4.x and 5.x both load this: per-expert tensors, both expert-count keys, top-level rope_theta
        assert config["num_experts"] == config["num_local_experts"] == 4 and config["rope_theta"] == 1e6
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in index["weight_map"]


def test_bf16_export_loads(tmp_path, moeckpt_cli):
    ckpt = _init(moeckpt_cli, tmp_path / "ck", "zaya-tiny", 1, 1, 1)
    out = _export(moeckpt_cli, ckpt, tmp_path / "hf", "--dtype", "bf16")
    raw = (out / "model-00001-of-00001.safetensors").read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8 : 8 + hlen])["model.embed_tokens.weight"]["dtype"] == "BF16"
    hf, info = _from_pretrained(out)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    want = CheckpointReader(str(ckpt)).read_tensor("model.embed_tokens.weight").to(torch.bfloat16).float()
    assert torch.equal(hf.model.embed_tokens.weight, want)


def test_fp32_export_of_bf16_training_takes_the_master_weights(tmp_path, moeckpt_cli):
    """bf16 parameters are the masters rounded; an fp32 export writes the masters, not the rounded values."""
    from safetensors.torch import load_file

    ckpt = _init(moeckpt_cli, tmp_path / "ck", "zaya-tiny", 1, 2, 2, "--dtype", "bf16", "--with-optimizer")
    reader = CheckpointReader(str(ckpt))
    name = "model.embed_tokens.weight"
    master = reader.read_tensor(f"master/{name}")
    master.add_(torch.randn(master.shape) * 1e-3)  # masters that bf16 cannot hold exactly, as training leaves them
    from moeckpt.reshard.layout import Layout
    from moeckpt.reshard.save import save_full_tensors

    values = {n: reader.read_tensor(n) for n in reader.index.tensors}
    values[f"master/{name}"] = master
    save_full_tensors(
        str(tmp_path / "ck2"),
        tensors=reader.index.tensors,
        layout=Layout(ep=2, dp=2),
        values=lambda e: values[e.name],
        model=reader.index.model,
    )
    out = _export(moeckpt_cli, tmp_path / "ck2", tmp_path / "hf", "--dtype", "fp32")
    got = load_file(str(out / "model-00001-of-00001.safetensors"))[name]
    assert got.dtype == torch.float32 and torch.equal(got, master)
    assert not torch.equal(got, values[name].float())
    out16 = _export(moeckpt_cli, tmp_path / "ck2", tmp_path / "hf16")  # default: the parameters' own dtype
    assert torch.equal(load_file(str(out16 / "model-00001-of-00001.safetensors"))[name], values[name])


@pytest.mark.parametrize("preset", TINY)
def test_import_then_export_is_identical(tmp_path, moeckpt_cli, preset):
    ckpt = _init(moeckpt_cli, tmp_path / "ck", preset, 1, 1, 1)
    first = _export(moeckpt_cli, ckpt, tmp_path / "hf1", "--max-shard-size", "120KB")
    code, _, err = moeckpt_cli(
        "import-hf", first, tmp_path / "ck2", "--tp", 2, "--ep", 2, "--dp", 2, "--format", "zarr"
    )
    assert code == 0, err
    reader = CheckpointReader(str(tmp_path / "ck2"))
    assert reader.index.layout == {"tp": 2, "ep": 2, "dp": 2}
    assert all(reader.read_tensor(n).abs().sum() == 0 for n, t in reader.index.tensors.items() if t.role == "exp_avg")
    second = _export(moeckpt_cli, tmp_path / "ck2", tmp_path / "hf2", "--max-shard-size", "120KB")
    assert _files(first) == _files(second)


def test_import_of_fused_expert_layout(tmp_path, moeckpt_cli):
    """A transformers 5 state dict (fused experts, one unindexed file) imports to the same model."""
    ckpt = _init(moeckpt_cli, tmp_path / "ck", "qwen3moe-tiny", 1, 1, 1)
    per_expert = _export(moeckpt_cli, ckpt, tmp_path / "hf1")
    hf, _ = _from_pretrained(per_expert)
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"))
    (fused / "config.json").write_text((per_expert / "config.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    code, _, err = moeckpt_cli("import-hf", fused, tmp_path / "ck2", "--tp", 2, "--dp", 2)
    assert code == 0, err
    assert _files(_export(moeckpt_cli, tmp_path / "ck2", tmp_path / "hf2")) == _files(per_expert)


def _rewrite_index_model(ckpt, change):
    path = os.path.join(ckpt, INDEX_NAME)
    doc = json.loads(open(path).read())
    change(doc["model"])
    with open(path, "w") as f:
        json.dump(doc, f)


def test_refusals(tmp_path, moeckpt_cli):
    ckpt = _init(moeckpt_cli, tmp_path / "ck", "qwen3moe-tiny", 1, 1, 1)
    hf = _export(moeckpt_cli, ckpt, tmp_path / "hf", "--max-shard-size", "100KB")

    def refused(*args, match):
        code, out, err = moeckpt_cli(*args)
        assert code == 2 and match in err and len(err.strip().splitlines()) == 1, (code, err)

    refused("export-hf", ckpt, hf, match="not empty")
    refused("export-hf", ckpt, tmp_path / "x", "--max-shard-size", "lots", match="not a size")

    bad_arch = _init(moeckpt_cli, tmp_path / "ck-arch", "zaya-tiny", 1, 1, 1)
    _rewrite_index_model(bad_arch, lambda m: m.update(arch="llama"))
    refused("export-hf", bad_arch, tmp_path / "x", match="'llama'")

    no_field = _init(moeckpt_cli, tmp_path / "ck-field", "zaya-tiny", 1, 1, 1)
    _rewrite_index_model(no_field, lambda m: m["config"].pop("num_experts"))
    refused("export-hf", no_field, tmp_path / "x", match="lacks num_experts")

    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    refused("import-hf", hf, tmp_path / "y", match="model_type 'llama'")
    # RoPE scaling the trainer does not implement would silently change every position's numbers
    (hf / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    refused("import-hf", hf, tmp_path / "y", match="rope scaling 'yarn' is not supported")
    # a shape field missing: named, instead of a default shape and a confusing "tensor ... is missing"
    (hf / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k not in ("num_experts", "num_local_experts")})
    )
    refused("import-hf", hf, tmp_path / "y", match="lacks num_experts")
    (hf / "config.json").write_text(json.dumps(config))

    index_path = hf / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and index["weight_map"]["model.embed_tokens.weight"] == shards[0]
    moved = dict(index, weight_map=dict(index["weight_map"], **{"model.embed_tokens.weight": shards[-1]}))
    index_path.write_text(json.dumps(moved))
    refused("import-hf", hf, tmp_path / "y", match="does not match")
    index_path.write_text(json.dumps(index))

    os.remove(hf / shards[1])
    refused("import-hf", hf, tmp_path / "y", match="missing")
    assert not (tmp_path / "y").exists()


_RSS_SCRIPT = """
import resource, sys
from moeckpt.reshard.layout import Layout
from moeckpt.trainer.hf_import import HfImport
job = HfImport(sys.argv[1], layout=Layout(tp=1, ep=2, dp=2))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[3] == "import":
    job.write(sys.argv[2], workers=2, chunk_bytes=1 << 20, slab_bytes=1 << 20, cache_bytes=4 << 20)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


def test_import_streams_in_bounded_memory(tmp_path, moeckpt_cli):
    """import-hf reads and writes in row chunks: the peak memory it adds stays far below the model's size.

    A Qwen3-MoE of 25.7M fp32 parameters (103 MB; 309 MB written with the AdamW moments), per-expert HF layout,
    imported with 1 MB chunks and a 4 MB cache: the import must add under a quarter of the model to the peak RSS
    of the process (holding the parameters whole, as imports used to, adds at least all of it). glibc's dynamic
    mmap threshold is pinned so that freed chunks go back to the system: otherwise its per-thread arenas keep
    tens of MB of freed chunks and the peak measures the allocator, not what the import holds.
    """
    import subprocess
    import sys

    cfg = {
        "arch": "qwen3_moe",
        "config": {
            "vocab_size": 256,
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "moe_intermediate_size": 512,
            "num_experts": 32,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 512,
        },
    }
    (tmp_path / "big.json").write_text(json.dumps(cfg))
    _init(moeckpt_cli, tmp_path / "ck", str(tmp_path / "big.json"), 1, 1, 1)
    hf = _export(moeckpt_cli, tmp_path / "ck", tmp_path / "hf")
    model_bytes = CheckpointReader(str(tmp_path / "ck")).index.nbytes  # the fp32 parameters
    assert model_bytes > 100e6

    def added_peak(mode: str) -> int:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        out = subprocess.run(
            [sys.executable, "-c", _RSS_SCRIPT, str(hf), str(tmp_path / f"ck-{mode}"), mode],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        return int(out.stdout.strip().splitlines()[-1])

    added = added_peak("import")
    assert added < model_bytes / 4, (
        f"import added {added / 1e6:.1f} MB to the peak RSS for a {model_bytes / 1e6:.1f} MB model"
    )
    reader = CheckpointReader(str(tmp_path / "ck-import"))
    assert reader.index.nbytes == 3 * model_bytes  # parameters and two AdamW moments
    _export(moeckpt_cli, tmp_path / "ck-import", tmp_path / "hf2")
    assert _files(tmp_path / "hf2") == _files(hf)
