"""Small builders shared by the format tests."""

from __future__ import annotations

import fsspec.core
import torch

from moeckpt.formats.index import TensorEntry
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import ParamSpec, logical_tensors
from moeckpt.trainer.init_values import initial_value


def toy_params() -> list[ParamSpec]:
    """A toy MoE-shaped parameter set touching every rule kind: plain, fused blocks, window, experts, replicated."""
    return [
        ParamSpec(name="embed.weight", shape=(16, 8), rule=ShardingRule(tp=TpSplit(dim=0))),
        ParamSpec(name="attn.o.weight", shape=(8, 12), rule=ShardingRule(tp=TpSplit(dim=1))),
        ParamSpec(name="attn.conv.weight", shape=(12, 1, 2), rule=ShardingRule(tp=TpSplit(dim=0, blocks=(8, 4)))),
        ParamSpec(name="attn.v_cur.weight", shape=(2, 8), rule=ShardingRule(tp=TpSplit(dim=0, window=(0, 4)))),
        ParamSpec(name="attn.v_del.weight", shape=(2, 8), rule=ShardingRule(tp=TpSplit(dim=0, window=(2, 4)))),
        ParamSpec(
            name="moe.experts.gate_up",
            shape=(4, 12, 8),
            rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=1, blocks=(6, 6))),
        ),
        ParamSpec(name="moe.experts.down", shape=(4, 8, 6), rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=2))),
        ParamSpec(name="norm.weight", shape=(8,), init="ones"),
        ParamSpec(name="router.bias", shape=(5,), init="zeros"),
    ]


def toy_tensors(param_dtype: str = "bfloat16", with_optimizer: bool = True) -> dict[str, TensorEntry]:
    return logical_tensors(toy_params(), param_dtype=param_dtype, with_optimizer=with_optimizer)


def toy_values(seed: int = 0):
    init = {p.name: p.init for p in toy_params()}
    return lambda e: initial_value(e, seed=seed, init=init.get(e.param, "normal"), std=1.0)


def save_toy(location: str, layout: Layout, backend: str = "safetensors", **kw):
    tensors = toy_tensors()
    return save_full_tensors(
        location,
        tensors=tensors,
        layout=layout,
        values=toy_values(),
        model={"arch": "toy", "config": {}},
        backend=backend,
        step=7,
        train_state={"step": 7, "consumed_samples": 112},
        **kw,
    )


def list_objects(location: str) -> list[str]:
    """Every stored file/object below ``location`` (relative paths), on any storage."""
    s = open_storage(location)
    if s.is_local:
        fs, root = fsspec.core.url_to_fs(s.location)
    else:
        fs, root = s.fs, s._fspath()
    root = root.rstrip("/")
    return sorted(p[len(root) + 1 :] for p in fs.find(root))


def flip_byte(location: str, relpath: str, offset: int) -> None:
    s = open_storage(location)
    data = bytearray(s.read_bytes(relpath))
    data[offset] ^= 0x40
    s.write_bytes(relpath, bytes(data))


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN-safe and dtype-exact."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


#: a 16-layer Qwen3-MoE whose checkpoint (fp32, no optimizer state) is about 105 MB, largest tensor 4.2 MB: big
#: enough that holding a writer's share shows in the peak RSS, small enough for CI.
QWEN_105MB = {
    "arch": "qwen3_moe",
    "config": {
        "vocab_size": 256,
        "hidden_size": 256,
        "num_hidden_layers": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "moe_intermediate_size": 128,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 512,
    },
}


def init_qwen_105mb(moeckpt_cli, tmp_path) -> tuple[str, int]:
    """``moeckpt init`` of :data:`QWEN_105MB` at ``tmp_path/src`` in tp=1 ep=2 dp=2; its location and bytes."""
    import json

    from moeckpt.formats.checkpoint import CheckpointReader

    (tmp_path / "m.json").write_text(json.dumps(QWEN_105MB))
    code, _, err = moeckpt_cli(
        "init", tmp_path / "src", "--model", tmp_path / "m.json", "--tp", 1, "--ep", 2, "--dp", 2
    )
    assert code == 0, err
    nbytes = CheckpointReader(str(tmp_path / "src")).index.nbytes
    assert nbytes > 100e6
    return str(tmp_path / "src"), nbytes


def check_shrink_and_grow(result, steps: int) -> None:
    """What every CPU elastic drill (trainer/elastic_drill.py) must show: both surviving nodes exit 0, the world
    goes 4 -> 2 -> 4 workers, the run reaches ``steps``, and the steps lost with the killed node are trained again
    by 2 workers to the losses 4 had (within 1e-4)."""
    logs = "\n".join(f"--- node {n}\n{text[-3000:]}" for n, text in result.logs.items())
    assert result.exit_codes == {"A": 0, "C": 0}, logs
    worlds = [w for _, w in result.worlds()]
    assert "4,2,4" in ",".join(map(str, worlds)), (worlds, logs)  # node A may train a step alone before B joins
    assert result.steps()[-1]["step"] == steps
    by_world: dict[int, dict[int, float]] = {}
    for r in result.steps():
        by_world.setdefault(r["world"], {})[r["step"]] = r["loss"]
    again = {s: loss for s, loss in by_world.get(2, {}).items() if s in by_world.get(4, {})}
    assert again and all(abs(loss - by_world[4][s]) < 1e-4 for s, loss in again.items()), (again, by_world)
