"""Every field of a model config.json, given a hostile value, is refused by name before anything is built:
exit 2, one line naming the file and the field, nothing written (``moeckpt init X --model cfg.json``)."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest

from moeckpt.trainer.models import ARCHITECTURES, presets

#: JSON values nobody means as a model dimension, rate or flag.
HOSTILE = [-1, 0, math.nan, math.inf, -math.inf, 10**12, "big", "", None, True, [1], {"a": 1}]
#: (arch, field) -> the hostile values that are legitimate there.
ACCEPTED = {
    ("zaya", "initializer_range"): [0],
    ("qwen3_moe", "initializer_range"): [0],
    ("zaya", "tie_word_embeddings"): [True],
    ("qwen3_moe", "tie_word_embeddings"): [True],
    ("qwen3_moe", "norm_topk_prob"): [True],
    # checkpoint-only families: flags, optional blocks (0 dense layers, no shared expert, full-rank queries), a
    # dense layer's number, and the verbatim rest of the config.json (any JSON object)
    **{(arch, "tie_word_embeddings"): [True] for arch in ("deepseek_v3", "mixtral", "olmoe", "gpt_oss")},
    **{(arch, "tie_word_embeddings"): [True] for arch in ("qwen2_moe", "glm4_moe")},
    **{(arch, "attention_bias"): [True] for arch in ("deepseek_v3", "olmoe", "gpt_oss", "glm4_moe")},
    ("qwen2_moe", "qkv_bias"): [True],
    ("glm4_moe", "use_qk_norm"): [True],
    **{(arch, f): [0] for arch in ("deepseek_v3", "glm4_moe") for f in ("first_k_dense_replace", "n_shared_experts")},
    ("deepseek_v3", "q_lora_rank"): [None],
    ("qwen2_moe", "mlp_only_layers"): [[1]],
    **{
        (arch, "hf_config"): [{"a": 1}]
        for arch in ("deepseek_v3", "mixtral", "olmoe", "gpt_oss", "qwen2_moe", "glm4_moe")
    },
}
#: the tiny preset of each architecture: a base whose every other field is valid and small.
BASE = {
    "zaya": "zaya-tiny",
    "qwen3_moe": "qwen3moe-tiny",
    "deepseek_v3": "deepseekv3-tiny",
    "mixtral": "mixtral-tiny",
    "olmoe": "olmoe-tiny",
    "gpt_oss": "gptoss-tiny",
    "qwen2_moe": "qwen2moe-tiny",
    "glm4_moe": "glm4moe-tiny",
}


def _cases():
    for arch, module in ARCHITECTURES.items():
        for f in dataclasses.fields(module.CONFIG_CLASS):
            yield pytest.param(arch, f.name, id=f"{arch}-{f.name}")


def _refused(tmp_path, moeckpt_cli, doc: dict, field: str) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc))  # NaN and Infinity as JSON writes them (json.loads reads them back)
    t0 = time.monotonic()
    code, out, err = moeckpt_cli("init", tmp_path / "ck", "--model", path)
    where = f"{field}={doc['config'][field] if 'config' in doc else doc[field]!r}: exit {code}\n{err}{out}"
    assert time.monotonic() - t0 < 10, "refused only after building the model: " + where
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, where
    assert str(path) in lines[0] and f"{field}=" in lines[0], where
    assert not (tmp_path / "ck").exists(), where


@pytest.mark.parametrize("arch, field", list(_cases()))
def test_every_field_refuses_hostile_values(arch, field, tmp_path, moeckpt_cli):
    base = presets()[BASE[arch]].to_json()
    accepted = ACCEPTED.get((arch, field), [])
    for value in HOSTILE:
        if any(value is a or (type(value) is type(a) and value == a) for a in accepted):
            continue
        doc = {"arch": arch, "config": {**base["config"], field: value}}
        _refused(tmp_path, moeckpt_cli, doc, field)


@pytest.mark.parametrize(
    "model_type, field, value",
    [
        ("zaya", "hidden_size", "big"),
        ("zaya", "vocab_size", -5),
        ("zaya", "num_experts", 0),
        ("zaya", "rms_norm_eps", math.nan),
        ("qwen3_moe", "head_dim", 10**12),
        ("qwen3_moe", "num_experts", 0),
    ],
)
def test_hugging_face_config_json_fields_are_checked_too(model_type, field, value, tmp_path, moeckpt_cli):
    arch = {"zaya": "zaya", "qwen3_moe": "qwen3_moe"}[model_type]
    doc = {"model_type": model_type, **presets()[BASE[arch]].to_json()["config"], field: value}
    _refused(tmp_path, moeckpt_cli, doc, field)


def test_divisibility_and_derived_sizes_are_checked(tmp_path, moeckpt_cli):
    base = presets()["zaya-tiny"].to_json()["config"]
    for edit, named in (
        ({"num_attention_heads": 3}, "num_attention_heads"),
        ({"num_key_value_heads": 1, "num_attention_heads": 1, "head_dim": 15}, "head_dim"),
    ):
        path = tmp_path / "model.json"
        path.write_text(json.dumps({"arch": "zaya", "config": {**base, **edit}}))
        code, _, err = moeckpt_cli("init", tmp_path / "ck", "--model", path)
        assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    qwen = presets()["qwen3moe-tiny"].to_json()["config"]
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"arch": "qwen3_moe", "config": {**qwen, "head_dim": 15}}))
    code, _, err = moeckpt_cli("init", tmp_path / "ck", "--model", path)
    assert code == 2 and "head_dim=15" in err, err


def test_a_model_too_big_for_memory_is_refused_before_allocating(tmp_path, moeckpt_cli):
    base = presets()["zaya-tiny"].to_json()["config"]
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"arch": "zaya", "config": {**base, "hidden_size": 2**31 - 1}}))
    t0 = time.monotonic()
    code, _, err = moeckpt_cli("init", tmp_path / "ck", "--model", path)
    assert code == 2 and "GB available" in err and len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - t0 < 10 and not (tmp_path / "ck").exists()
    code, _, err = moeckpt_cli("train", "--model", "zaya1-8b", "--run-dir", tmp_path / "run", "--cpu")
    assert code == 2 and "GB available" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
