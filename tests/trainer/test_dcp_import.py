"""import-dcp and export-dcp without the frameworks installed: generic checkpoints, sources on memory:// and S3,
hostile options, and the torchtitan and Megatron mappings on DCP checkpoints written with their names and
shardings (real dcp.save, DTensors over 4 gloo processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.dcp import open_dcp
from moeckpt.reshard.layout import Layout
from moeckpt.trainer.interop import MappingError, import_dcp

from ..dcp_workers import TINY, hf_config_json

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where the workers live


def _save(path, sd) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return str(path)


def torchrun(kind: str, out: str, nproc: int) -> None:
    """Run a dcp_workers writer under torchrun; fails the test with its output if it fails."""
    torchrun_worker("dcp_workers.py", kind, out, nproc=nproc)


def torchrun_worker(script: str, *args: str, nproc: int) -> None:
    """Run ``tests/<script> ARGS`` under torchrun on ``nproc`` gloo ranks; fails the test with its output if it
    fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        # the agent's store binds a port of the kernel's choosing: a port picked here and bound later by torchrun
        # was taken in between by another test's process once in CI (EADDRINUSE)
        "--standalone",
        os.path.join(HERE, script),
        *args,
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]


@pytest.fixture
def generic_dcp(tmp_path) -> tuple[str, dict]:
    sd = {
        "w": torch.randn(8, 6),
        "block": {"b": torch.randn(5).to(torch.bfloat16), "i": torch.arange(7)},
        "step": 11,
        "sched": {"last_epoch": 3},
    }
    return _save(tmp_path / "dcp", sd), sd


def test_mapping_none_is_a_generic_checkpoint(generic_dcp, tmp_path, moeckpt_cli):
    src, sd = generic_dcp
    dst = tmp_path / "ck"
    code, _, err = moeckpt_cli("import-dcp", src, dst, "--dp", "2", "--format", "zarr")
    assert code == 0, err
    reader = CheckpointReader(str(dst))
    assert reader.index.model == {"arch": "generic", "config": {}}
    # --dp 2: every tensor split along dim 0 over two files (0-d ones replicated), as a mesh sharding
    assert {t.sharding_key for t in reader.index.tensors.values()} == {'{"mesh": 0, "placements": ["S(0)"]}'}
    assert reader.index.meshes[0].shape == (2,) and reader.index.layout == {}
    assert torch.equal(reader.read_tensor("w"), sd["w"])
    assert torch.equal(reader.read_tensor("block.b"), sd["block"]["b"])
    assert torch.equal(reader.read_tensor("block.i"), sd["block"]["i"])
    assert reader.index.train_state["dcp_values"] == {"step": 11, "sched.last_epoch": 3}
    assert moeckpt_cli("verify", dst)[0] == 0
    assert moeckpt_cli("inspect", dst)[0] == 0
    assert moeckpt_cli("reshard", dst, tmp_path / "re", "--dp", "3", "--format", "safetensors")[0] == 0
    assert moeckpt_cli("diff", dst, tmp_path / "re")[0] == 0
    # and back out: the same tensors and values under the same keys
    code, _, err = moeckpt_cli("export-dcp", tmp_path / "re", tmp_path / "back")
    assert code == 0, err
    back = open_dcp(str(tmp_path / "back"))
    assert torch.equal(back.read_tensor("block.b"), sd["block"]["b"])
    assert back.read_value("step") == 11 and back.read_value("sched.last_epoch") == 3
    loaded = {
        "w": torch.zeros(8, 6),
        "block": {"b": torch.zeros(5, dtype=torch.bfloat16), "i": torch.zeros(7, dtype=torch.int64)},
        "step": 0,
        "sched": {"last_epoch": 0},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    assert torch.equal(loaded["w"], sd["w"]) and loaded["step"] == 11


def test_export_dcp_pickles_no_value(generic_dcp, tmp_path, moeckpt_cli, monkeypatch):
    """DCP's own save planner torch.saves (pickles) every non-tensor value; export-dcp writes them with its
    pickle-free encoder, which torch.load (weights only) and DCP's load read back. (A tensor record is DCP's
    file format itself: its writer torch.saves each plain tensor.)"""
    src, _ = generic_dcp
    assert moeckpt_cli("import-dcp", src, tmp_path / "ck")[0] == 0
    real, tensors = torch.save, []

    def tensors_only(obj, f, *args, **kwargs):
        if type(obj) is not torch.Tensor:
            raise AssertionError(f"export-dcp pickled a {type(obj).__name__}")
        tensors.append(obj.shape)
        return real(obj, f, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch, "save", tensors_only)
        code, _, err = moeckpt_cli("export-dcp", tmp_path / "ck", tmp_path / "back")
    assert tensors  # the patch was in the writer's way
    assert code == 0, err
    back = open_dcp(str(tmp_path / "back"))
    assert back.read_value("step") == 11 and back.read_value("sched.last_epoch") == 3
    loaded = {"w": torch.zeros(8, 6), "step": 0, "sched": {"last_epoch": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, checkpoint_id=str(tmp_path / "back"), no_dist=True, planner=_weights_only_planner())
    assert loaded["step"] == 11 and loaded["sched"] == {"last_epoch": 3}


def _weights_only_planner():
    """DCP's load planner reading each value with ``torch.load(weights_only=True)``: plain data only."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            real = torch.load
            try:  # the default planner's own load_bytes (its unflattening), with the weights-only unpickler
                torch.load = lambda f, weights_only=False: real(f, weights_only=True)  # type: ignore[assignment]
                super().load_bytes(read_item, value)
            finally:
                torch.load = real

    return WeightsOnly()


def test_mapping_none_without_a_layout_keeps_the_dcp_shardings(tmp_path, moeckpt_cli):
    """No layout given: each DCP chunk becomes a piece in the file of the rank that wrote it (the names and the
    shardings as they are); moeckpt.load fills a state dict from it, and reshard regroups it."""
    import moeckpt
    from moeckpt.trainer.local_world import run_local_world

    from ..dcp_workers import save_sharded_generic

    src = str(tmp_path / "dcp")
    run_local_world(save_sharded_generic, 2, src)
    code, _, err = moeckpt_cli("import-dcp", src, tmp_path / "ck")
    assert code == 0, err
    reader = CheckpointReader(str(tmp_path / "ck"))
    assert {t.sharding_key for t in reader.index.tensors.values()} == {'{"pieces": "stored"}'}
    assert reader.index.written_version == 2 and sorted(reader.index.files) == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    rows = {r.tensor: (r.box.offsets, r.file) for r in reader.pieces() if r.tensor == "w"}
    assert len([r for r in reader.pieces() if r.tensor == "w"]) == 2, rows  # the two ranks' row shards of w
    out = {"w": torch.zeros(8, 6), "b": torch.zeros(4)}
    moeckpt.load(out, str(tmp_path / "ck"))
    assert torch.equal(out["w"], torch.arange(48.0).reshape(8, 6)) and torch.equal(out["b"], torch.ones(4))
    assert moeckpt_cli("verify", tmp_path / "ck")[0] == 0
    assert moeckpt_cli("reshard", tmp_path / "ck", tmp_path / "one", "--dp", "1")[0] == 0
    assert moeckpt_cli("diff", tmp_path / "ck", tmp_path / "one")[0] == 0


def _copy_to(fs_url: str, local: str) -> None:
    fs, root = fsspec.core.url_to_fs(fs_url)
    for name in os.listdir(local):
        with open(os.path.join(local, name), "rb") as f:
            fs.pipe(f"{root}/{name}", f.read())


def test_reads_ahead_are_hinted_on_local_disk_only(generic_dcp, tmp_path, monkeypatch):
    """The chunk records' probes are hinted before they are read, and a writer's next rows before it copies them
    (the kernel reads them meanwhile); on other storages, or where the hint fails, nothing happens."""
    from moeckpt.formats.dcp import payload
    from moeckpt.formats.pieces import PieceRef
    from moeckpt.reshard.dcp_source import DcpPieceReader

    path, _ = generic_dcp
    hints: list[tuple[int, int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, n, advice: hints.append((start, n, advice)))
    d = open_dcp(path)
    chunks = d.chunks()
    records = [c.record for t in d.tensors.values() for c in t.chunks]
    for rec in records:  # the head of every record, and the tail of those longer than one probe
        assert (rec.offset, min(rec.length, payload.PROBE_BYTES), os.POSIX_FADV_WILLNEED) in hints
        if rec.length > payload.PROBE_BYTES:
            tail = (rec.offset + rec.length - payload.PROBE_BYTES, payload.PROBE_BYTES, os.POSIX_FADV_WILLNEED)
            assert tail in hints
    hints.clear()
    w = chunks["w"][0]  # 8 x 6 fp32 rows: rows 2..5 start 2 rows in
    ref = PieceRef("w", w.box, w.dtype, w.file, w.start, w.nbytes, (), block_bytes=0)
    DcpPieceReader(d, None).advise(ref, 2, 5)
    assert hints == [(w.start + 2 * 6 * 4, 3 * 6 * 4, os.POSIX_FADV_WILLNEED)]

    def refuses(*a):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuses)
    d.advise(w.file, 0, 10)  # a hint that fails is no error
    monkeypatch.setattr(os, "posix_fadvise", real)
    d.close()
    fs = fsspec.filesystem("memory")
    _copy_to("memory://hinted", path)
    remote = open_dcp("memory://hinted")
    remote.advise(w.file, 0, 10)  # no file descriptor to hint: nothing, no error
    assert remote.chunks()["w"][0].start == w.start
    fs.rm("/hinted", recursive=True)


def test_source_on_memory_and_s3(generic_dcp, tmp_path, s3_url, moeckpt_cli):
    src, sd = generic_dcp
    for i, url in enumerate((f"memory://dcp-tests/{os.getpid()}/src", s3_url)):
        _copy_to(url, src)
        if i:  # through the command line too
            code, _, err = moeckpt_cli("import-dcp", url, tmp_path / "cli", "--tp", "1", "--dp", "2")
            assert code == 0, err
            assert torch.equal(CheckpointReader(str(tmp_path / "cli")).read_tensor("w"), sd["w"])
        index = import_dcp(url, str(tmp_path / f"out{i}"), layout=Layout(dp=2))
        reader = CheckpointReader(str(tmp_path / f"out{i}"))
        assert torch.equal(reader.read_tensor("w"), sd["w"]), url
        assert index.train_state["imported_from"].startswith(url.split("://")[0])


@pytest.mark.parametrize(
    "args, what",
    [
        (["--tp", "-1"], "--tp"),
        (["--tp", "nan"], "--tp"),
        (["--dp", "0"], "--dp"),
        (["--ep", "1e999"], "--ep"),
        (["--workers", "0"], "--workers"),
        (["--workers", "x"], "--workers"),
        (["--mapping", "deepspeed"], "--mapping"),
        (["--format", "npz"], "--format"),
        (["--mapping", "torchtitan", "--model", "no-such-preset"], "preset"),
        (["--model", "qwen3moe-tiny"], "--model applies to a named mapping"),
        (["--mapping", "torchtitan"], "not part of torchtitan"),
        (["--mapping", "megatron"], "not part of a Megatron"),
    ],
)
def test_hostile_options_are_one_line(generic_dcp, tmp_path, moeckpt_cli, args, what):
    src, _ = generic_dcp
    code, out, err = moeckpt_cli("import-dcp", src, tmp_path / "dst", *args)
    assert code == 2, (out, err)
    assert what in err and "Traceback" not in err, err
    assert not (tmp_path / "dst").exists()


def test_destination_rules(generic_dcp, tmp_path, moeckpt_cli):
    src, _ = generic_dcp
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    code, _, err = moeckpt_cli("import-dcp", src, tmp_path / "full")
    assert code == 2 and "not empty" in err
    assert (tmp_path / "full" / "keep").read_text() == "x"
    assert moeckpt_cli("import-dcp", src, tmp_path / "ck")[0] == 0
    code, _, err = moeckpt_cli("export-dcp", tmp_path / "ck", tmp_path / "full")
    assert code == 2 and "not empty" in err
    code, _, err = moeckpt_cli("export-dcp", tmp_path / "ck", tmp_path / "x", "--mapping", "torchtitan")
    assert code == 2 and "qwen3_moe" in err


# -- torchtitan's names and shardings, without torchtitan ---------------------------------------------------------


@pytest.fixture(scope="module")
def titan_named(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("titan") / "dcp")
    torchrun("titan-names", out, 4)
    return out


def _titan_to_hf(full: dict) -> dict:
    """torchtitan names -> transformers' Qwen3-MoE names (written out independently of moeckpt's mapping)."""
    out = {
        "model.embed_tokens.weight": full["tok_embeddings.weight"],
        "model.norm.weight": full["norm.weight"],
        "lm_head.weight": full["lm_head.weight"],
    }
    for i in range(TINY["n_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        for a, b in (
            ("attention.qkv_linear.wq", "self_attn.q_proj"),
            ("attention.qkv_linear.wk", "self_attn.k_proj"),
            ("attention.qkv_linear.wv", "self_attn.v_proj"),
            ("attention.wo", "self_attn.o_proj"),
            ("attention.q_norm", "self_attn.q_norm"),
            ("attention.k_norm", "self_attn.k_norm"),
            ("attention_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
            ("moe.router.gate", "mlp.gate"),
        ):
            out[f"{q}{b}.weight"] = full[f"{p}{a}.weight"]
        x = p + "moe.routed_experts.inner_experts."
        # transformers 5 keeps experts fused: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I]
        out[f"{q}mlp.experts.gate_up_proj"] = torch.cat([full[x + "w1_EFD"], full[x + "w3_EFD"]], dim=1)
        out[f"{q}mlp.experts.down_proj"] = full[x + "w2_EDF"]
    return out


def _transformers_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def test_torchtitan_names_to_hf_and_back(titan_named, tmp_path, moeckpt_cli):
    import transformers
    from safetensors.torch import load_file

    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps(hf_config_json()))
    ck, hf = tmp_path / "ck", tmp_path / "hf"
    code, _, err = moeckpt_cli(
        "import-dcp",
        titan_named,
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
        model_json,
    )
    assert code == 0, err
    assert "expert_bias" in err  # the dropped (zero) biases are named
    reader = CheckpointReader(str(ck))
    assert reader.index.train_state["step"] == 2 and reader.index.train_state["optimizer"] == {"steps": 2}
    # AdamW moments came along, gate and up fused like the parameters
    dcp_ck = open_dcp(titan_named)
    got = reader.read_tensor("exp_avg/model.layers.1.mlp.experts.gate_up_proj")
    want = torch.cat(
        [
            dcp_ck.read_tensor(f"optimizer.state.layers.1.moe.routed_experts.inner_experts.{w}.exp_avg")
            for w in ("w1_EFD", "w3_EFD")
        ],
        dim=1,
    )
    assert torch.equal(got, want)
    assert moeckpt_cli("export-hf", ck, hf)[0] == 0
    # the reference: transformers loading the original weights under names written out by hand
    full = load_file(titan_named + ".weights.safetensors")
    cfg = transformers.AutoConfig.from_pretrained(str(hf))
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ref.load_state_dict(_titan_to_hf(full), strict=True)
    tokens = torch.randint(0, TINY["vocab"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits = ref(tokens).logits
    assert (_transformers_logits(str(hf), tokens) - want_logits).abs().max() < 1e-5
    # and back to DCP: every tensor and value of the original, bit for bit
    code, _, err = moeckpt_cli("export-dcp", ck, tmp_path / "back", "--mapping", "torchtitan")
    assert code == 0, err
    back = open_dcp(str(tmp_path / "back"))
    separate = ("wq.weight.", "wk.weight.", "wv.weight.")
    for name in dcp_ck.tensors:
        if name.startswith("optimizer.") and any(s in name for s in separate):
            continue  # this optimizer kept q, k and v apart; torchtitan 0.3 fuses them (checked below)
        a, b = dcp_ck.read_tensor(name), back.read_tensor(name)
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (
            name
        )
    # torchtitan 0.3's optimizer holds wqkv fused per key/value group: q heads of the group, its k head, its v head
    hd, nkv, per = TINY["head_dim"], TINY["n_kv_heads"], TINY["n_heads"] // TINY["n_kv_heads"]
    q, k, v = (
        dcp_ck.read_tensor(f"optimizer.state.layers.1.attention.qkv_linear.{w}.weight.exp_avg")
        for w in ("wq", "wk", "wv")
    )
    fused = torch.cat(
        [torch.cat([q.view(nkv, per * hd, -1)[g], k.view(nkv, hd, -1)[g], v.view(nkv, hd, -1)[g]]) for g in range(nkv)]
    )
    assert torch.equal(back.read_tensor("optimizer.state.layers.1.attention.qkv_linear.wqkv.weight.exp_avg"), fused)
    assert back.read_value("optimizer.param_groups.norm.weight.lr") == 1e-3


def test_torchtitan_mapping_refuses_what_qwen3_lacks(titan_named, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(titan_named, bad)
    # a trained (non-zero) expert bias: Qwen3-MoE would route differently
    dcp_ck = open_dcp(str(bad))
    chunk = dcp_ck.chunks(["layers.0.moe.expert_bias_E"])["layers.0.moe.expert_bias_E"][0]
    with open(bad / chunk.file, "r+b") as f:
        f.seek(chunk.start)
        f.write(torch.ones(chunk.box.numel).numpy().tobytes())
    with pytest.raises(MappingError, match="expert_bias_E is not zero"):
        import_dcp(str(bad), str(tmp_path / "x"), mapping="torchtitan")
    with pytest.raises(MappingError, match="qwen3_moe"):
        from moeckpt.trainer.models import resolve_model

        import_dcp(titan_named, str(tmp_path / "y"), mapping="torchtitan", model=resolve_model("zaya-tiny"))
    wrong = hf_config_json()
    wrong["config"]["num_experts"] = 8
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    with pytest.raises(MappingError, match="num_experts=8 but the checkpoint's tensors imply 4"):
        from moeckpt.trainer.models import resolve_model

        import_dcp(
            titan_named, str(tmp_path / "z"), mapping="torchtitan", model=resolve_model(str(tmp_path / "wrong.json"))
        )
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# -- Megatron-Core's names and shapes, without Megatron ------------------------------------------------------------


def _megatron_state(g: torch.Generator, with_optimizer: bool, per_expert: bool = False) -> tuple[dict, dict]:
    """Megatron torch_dist keys (stacked layers, QKV fused per query group, fc1 = [gate; up], experts [L, E, ...]
    or, with ``per_expert``, one key per global expert as ``singleton_local_shards`` saves them) and the Hugging
    Face tensors they stand for."""
    t = TINY
    layers, h, hd, nq, nkv, e, inter = (
        t["n_layers"],
        t["dim"],
        t["head_dim"],
        t["n_heads"],
        t["n_kv_heads"],
        t["experts"],
        t["moe_hidden"],
    )

    def r(*shape):
        return torch.randn(*shape, generator=g)

    hf, mg = {}, {}
    mg["embedding.word_embeddings.weight"] = hf["model.embed_tokens.weight"] = r(t["vocab"], h)
    mg["decoder.final_layernorm.weight"] = hf["model.norm.weight"] = r(h)
    mg["output_layer.weight"] = hf["lm_head.weight"] = r(t["vocab"], h)
    qkv, proj, qn, kn, ln1, ln2, router, fc1, fc2 = ([] for _ in range(9))
    for i in range(layers):
        p = f"model.layers.{i}."
        q, k, v = r(nq * hd, h), r(nkv * hd, h), r(nkv * hd, h)
        hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"] = (
            q,
            k,
            v,
        )
        per = nq // nkv
        qkv.append(
            torch.cat(
                [
                    torch.cat([q.view(nkv, per * hd, h)[g_], k.view(nkv, hd, h)[g_], v.view(nkv, hd, h)[g_]])
                    for g_ in range(nkv)
                ]
            )
        )
        proj.append(hf.setdefault(p + "self_attn.o_proj.weight", r(h, nq * hd)))
        qn.append(hf.setdefault(p + "self_attn.q_norm.weight", r(hd)))
        kn.append(hf.setdefault(p + "self_attn.k_norm.weight", r(hd)))
        ln1.append(hf.setdefault(p + "input_layernorm.weight", r(h)))
        ln2.append(hf.setdefault(p + "post_attention_layernorm.weight", r(h)))
        router.append(hf.setdefault(p + "mlp.gate.weight", r(e, h)))
        fc1.append(hf.setdefault(p + "mlp.experts.gate_up_proj", r(e, 2 * inter, h)))
        fc2.append(hf.setdefault(p + "mlp.experts.down_proj", r(e, h, inter)))
    d = "decoder.layers."
    for key, parts in (
        (d + "self_attention.linear_qkv.weight", qkv),
        (d + "self_attention.linear_proj.weight", proj),
        (d + "self_attention.q_layernorm.weight", qn),
        (d + "self_attention.k_layernorm.weight", kn),
        (d + "self_attention.linear_qkv.layer_norm_weight", ln1),
        (d + "mlp.linear_fc1.layer_norm_weight", ln2),
        (d + "mlp.router.weight", router),
        (d + "mlp.experts.experts.linear_fc1.weight", fc1),
        (d + "mlp.experts.experts.linear_fc2.weight", fc2),
    ):
        mg[key] = torch.stack(parts)
    if per_expert:
        for fc in ("linear_fc1", "linear_fc2"):
            fused = mg.pop(f"{d}mlp.experts.experts.{fc}.weight")
            for x in range(e):
                mg[f"{d}mlp.experts.{x}.{fc}.weight"] = fused[:, x].contiguous()
    if with_optimizer:
        for key in list(mg):
            for role in ("exp_avg", "exp_avg_sq"):
                mg[f"optimizer.state.{role}.{key}"] = mg[key] * (2.0 if role == "exp_avg" else 3.0)
    return mg, hf


def _save_megatron_like(path, mg: dict) -> None:
    """dcp.save in 2 gloo processes, each holding half of every stacked tensor's layers (Megatron saves each
    layer's chunk on its own) and TP halves of fc1's gate and up blocks."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in mg.items()}, str(path) + ".full.safetensors")
    torchrun_megatron_like(str(path))


def torchrun_megatron_like(path: str) -> None:
    code = (
        "import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp\n"
        "from safetensors.torch import load_file\n"
        "from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards\n"
        "dist.init_process_group('gloo'); r, w = dist.get_rank(), dist.get_world_size()\n"
        "full = load_file(sys.argv[1] + '.full.safetensors'); sd = {}\n"
        "for k, v in full.items():\n"
        "    if v.dim() < 2 or not (k.startswith('decoder.layers.') or k.startswith('optimizer.state')):\n"
        "        sd[k] = v; continue\n"
        "    boxes = [((l,) + (0,) * (v.dim() - 1), (1,) + tuple(v.shape[1:])) for l in range(v.shape[0])]\n"
        "    if 'linear_fc1.weight' in k:  # gate and up saved as separate chunks, as the swiglu factory does\n"
        "        d = v.dim() - 2; half = v.shape[d] // 2\n"
        "        boxes = [((l,) + (0,) * (d - 1) + (j * half, 0), (1,) + tuple(v.shape[1:d]) + (half, v.shape[-1]))\n"
        "                 for l in range(v.shape[0]) for j in (0, 1)]\n"
        "    mine = boxes[r::w]\n"
        "    shards = [Shard(v[tuple(slice(o, o + s) for o, s in zip(off, size))].clone(),\n"
        "                    ShardMetadata(list(off), list(size), f'rank:{r}/cpu')) for off, size in mine]\n"
        "    sd[k] = init_from_local_shards(shards, list(v.shape))\n"
        "dcp.save(sd, checkpoint_id=sys.argv[1])\n"
        "dist.barrier()  # every rank done before any tears its gloo connections down\n"
        "import gc, os; gc.collect(); dist.destroy_process_group()\n"
        "sys.stdout.flush(); sys.stderr.flush()\n"
        "os._exit(0)  # no interpreter teardown: gloo's threads abort it now and then (see dcp_workers.py)\n"
    )
    script = path + ".save.py"
    with open(script, "w") as f:
        f.write(code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--standalone",
            script,
            path,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-6000:]


@pytest.mark.parametrize("per_expert", [False, True], ids=["fused-experts", "per-expert"])
def test_megatron_names_map_onto_qwen3(tmp_path, moeckpt_cli, per_expert):
    mg, hf = _megatron_state(torch.Generator().manual_seed(5), with_optimizer=True, per_expert=per_expert)
    src = tmp_path / "mg"
    _save_megatron_like(src, mg)
    (src / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps(hf_config_json()))
    code, _, err = moeckpt_cli(
        "import-dcp",
        src,
        tmp_path / "ck",
        "--tp",
        "2",
        "--ep",
        "2",
        "--dp",
        "2",
        "--mapping",
        "megatron",
        "--model",
        model_json,
    )
    assert code == 0, err
    assert "common.pt" in err  # the step count it cannot read is named
    reader = CheckpointReader(str(tmp_path / "ck"))
    for name, value in hf.items():
        assert torch.equal(reader.read_tensor(name), value), name
        assert torch.equal(reader.read_tensor(f"exp_avg/{name}"), value * 2.0), name
        assert torch.equal(reader.read_tensor(f"exp_avg_sq/{name}"), value * 3.0), name
    (src / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    code, _, err = moeckpt_cli("import-dcp", src, tmp_path / "ck2", "--mapping", "megatron")
    assert code == 2 and "torch_dist" in err


def test_imported_torchtitan_checkpoint_trains_with_its_optimizer_state(titan_named, tmp_path, moeckpt_cli):
    """`train --init-from` an import: the first loss is the weights' (as from the same weights through
    Hugging Face, fresh optimizer), the second already shows the imported AdamW moments at work."""
    from moeckpt.trainer.metrics import read_metrics

    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps(hf_config_json()))
    assert (
        moeckpt_cli(
            "import-dcp",
            titan_named,
            tmp_path / "ck",
            "--mapping",
            "torchtitan",
            "--model",
            model_json,
            "--ep",
            "2",
            "--dp",
            "2",
        )[0]
        == 0
    )
    assert moeckpt_cli("export-hf", tmp_path / "ck", tmp_path / "hf")[0] == 0
    assert moeckpt_cli("import-hf", tmp_path / "hf", tmp_path / "fresh")[0] == 0
    common = ("--steps", 2, "--save-every", 2, "--warmup-steps", 1, "--seq-len", 32)
    losses = {}
    for name in ("ck", "fresh"):
        code, _, err = moeckpt_cli(
            "train", "--init-from", tmp_path / name, "--run-dir", tmp_path / f"run-{name}", *common
        )
        assert code == 0, err
        losses[name] = [r["loss"] for r in read_metrics(str(tmp_path / f"run-{name}")) if "loss" in r]
    assert abs(losses["ck"][0] - losses["fresh"][0]) < 1e-5
    assert abs(losses["ck"][1] - losses["fresh"][1]) > 1e-6


def test_each_chunk_is_read_once_and_a_truncation_meanwhile_is_caught(titan_named, tmp_path):
    import shutil

    from moeckpt.formats.dcp import DcpFormatError
    from moeckpt.trainer.interop import DcpImport
    from moeckpt.trainer.models import resolve_model

    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps(hf_config_json()))
    model = resolve_model(str(model_json))
    job = DcpImport(titan_named, layout=Layout(tp=2, ep=2, dp=4), mapping="torchtitan", model=model)
    mapped = {s.source for s in job.mapped.slots}
    stored = sum(c.nbytes for n, cs in job.dcp.chunks(sorted(mapped)).items() for c in cs)
    _, read = job.write(str(tmp_path / "ck"), workers=3)
    assert read == stored  # every byte of every mapped chunk, once
    # a data file cut short after the checks (the reader maps what it reads: it must refuse, not crash)
    src = tmp_path / "src"
    shutil.copytree(titan_named, src)
    job = DcpImport(str(src), layout=Layout(tp=2), mapping="torchtitan", model=model)
    with open(src / "__1_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DcpFormatError, match="truncated"):
        job.write(str(tmp_path / "ck2"))
    assert not (tmp_path / "ck2").exists() and not (tmp_path / ".ck2.partial").exists()


def test_older_torchtitan_rope_table_is_dropped_by_a_mapping_and_kept_without_one(titan_named, tmp_path, moeckpt_cli):
    """Older torchtitan saved its complex RoPE table (``freqs_cis``) with the model; a mapping recomputes it,
    ``--mapping none`` keeps it (complex64 is a moeckpt dtype)."""
    from safetensors.torch import load_file

    state = dict(load_file(titan_named + ".weights.safetensors"))
    state["freqs_cis"] = torch.polar(torch.ones(16, 8), torch.randn(16, 8))
    src = _save(tmp_path / "old", state)
    model_json = tmp_path / "model.json"
    model_json.write_text(json.dumps(hf_config_json()))
    code, _, err = moeckpt_cli("import-dcp", src, tmp_path / "ck", "--mapping", "torchtitan", "--model", model_json)
    assert code == 0, err
    assert "freqs_cis dropped" in err and "no optimizer state" in err
    code, _, err = moeckpt_cli("import-dcp", src, tmp_path / "generic")
    assert code == 0, err
    assert torch.equal(CheckpointReader(str(tmp_path / "generic")).read_tensor("freqs_cis"), state["freqs_cis"])
