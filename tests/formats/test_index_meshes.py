"""Format version 2: device meshes in the index, mesh shardings of tensors, and tensor names that are safe paths."""

from __future__ import annotations

import json

import pytest

from moeckpt.formats.errors import (
    CheckpointIndexError,
    UnsafePathError,
    UnsupportedVersionError,
)
from moeckpt.formats.index import FORMAT_VERSION, Index, MeshEntry, TensorEntry


def _index(**kw) -> Index:
    mesh = MeshEntry((2, 2), (0, 1, 2, 3))
    w = TensorEntry(
        name="w",
        shape=(4, 2),
        dtype="float32",
        role="param",
        param="w",
        sharding={"mesh": 0, "placements": ["S(0)", "R"]},
        mesh=mesh,
    )
    defaults = {
        "backend": "safetensors",
        "step": 1,
        "layout": {},
        "model": {"arch": "generic", "config": {}},
        "tensors": {"w": w},
        "files": {},
        "meshes": (mesh,),
    }
    defaults.update(kw)
    return Index(**defaults)


def test_an_index_with_meshes_is_version_2_and_round_trips():
    index = _index()
    raw = index.dumps()
    doc = json.loads(raw)
    assert doc["format_version"] == 2 and doc["meshes"] == [{"shape": [2, 2], "ranks": [0, 1, 2, 3]}]
    back = Index.loads(raw, "x")
    assert back.meshes == index.meshes and back.tensors["w"].mesh == index.meshes[0]
    assert back.dumps() == raw


def test_an_index_without_meshes_stays_version_1():
    index = _index(
        meshes=(), tensors={"n": TensorEntry(name="n", shape=(3,), dtype="float32", role="param", param="n")}
    )
    assert json.loads(index.dumps())["format_version"] == 1
    assert "meshes" not in json.loads(index.dumps())


def _doc(**changes) -> bytes:
    doc = json.loads(_index().dumps())
    doc.update(changes)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format_version": 1}, "need version 2"),
        ({"format_version": FORMAT_VERSION + 1}, "not supported"),
        ({"meshes": [{"shape": [2, 2], "ranks": [0, 1, 2]}]}, "lists 3 ranks"),
        ({"meshes": [{"shape": [2, 2], "ranks": [0, 1, 1, 2]}]}, "distinct"),
        ({"meshes": [{"shape": [0], "ranks": []}]}, "positive integers"),
        ({"meshes": {"shape": [1]}}, "must be a list"),
        ({"meshes": []}, "lists 0 mesh"),
    ],
)
def test_malformed_meshes_are_refused_with_one_line(changes, message):
    with pytest.raises((CheckpointIndexError, UnsupportedVersionError), match=message) as e:
        Index.loads(_doc(**changes), "ckpt/moeckpt.json")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["../evil", "a/../b", "/abs", "a//b", "a/./b", "back\\slash", "ctl\x01", "", "a/"])
def test_unsafe_tensor_names_are_refused_on_read(name):
    doc = json.loads(_index(meshes=(), tensors={}).dumps())
    doc["tensors"] = {name: {"shape": [1], "dtype": "float32", "role": "param", "param": "p", "sharding": {}}}
    with pytest.raises(UnsafePathError, match="not a safe name|non-empty"):
        Index.loads(json.dumps(doc).encode(), "x")


def test_dotted_and_nested_names_are_fine():
    doc = json.loads(_index(meshes=(), tensors={}).dumps())
    for name in ["model.layers.0.w", "exp_avg/model.layers.0.w", "optim.state.0.weight.exp_avg", "a..b"]:
        doc["tensors"] = {name: {"shape": [1], "dtype": "float32", "role": "param", "param": "p", "sharding": {}}}
        assert name in Index.loads(json.dumps(doc).encode(), "x").tensors
