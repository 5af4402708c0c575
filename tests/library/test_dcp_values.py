"""moeckpt.dcp's names for DCP keys and its typed JSON for non-tensor values: reversible, safe, no pickle."""

from __future__ import annotations

import io
import random

import pytest
import torch

from moeckpt.formats.backends.zarr import check_tensor_names
from moeckpt.formats.errors import StateDictError
from moeckpt.formats.index import check_tensor_name
from moeckpt.library.dcp_values import (
    blob_names,
    decode_key,
    decode_value,
    encode_key,
    encode_value,
    stream_value,
)

AWKWARD_KEYS = [
    "a//b",
    "/abs",
    "x/./y",
    "x/../y",
    "..",
    ".",
    "a\\b",
    "c:/drive",
    "trailing/",
    "//",
    "ctl\x00\x1f\x7f",
    "100%",
    "%41",
    "$0",
    "a/$1",
    "__dunder/__x",
    "zarr.json",
    "m/zarr.json",
    "moeckpt.json",
    "ünï/cödé",
    "model.layers.0.mlp.experts.w@1",
]


@pytest.mark.parametrize("key", AWKWARD_KEYS)
def test_every_key_has_a_safe_name_that_decodes_back(key):
    name = encode_key(key)
    check_tensor_name(name, "test")  # a safe relative path on every storage
    check_tensor_names([name])  # and a zarr array path
    assert decode_key(name) == key


def test_ordinary_keys_are_their_own_names():
    for key in ["model.net1.weight", "optim.state.0.exp_avg", "exp_avg/model.layers.0.w", "w@1", "a.b-c_d"]:
        assert encode_key(key) == key


def test_random_keys_round_trip_and_stay_distinct():
    rng = random.Random(7)
    alphabet = "ab/.%$\\_\x01 zj"
    keys = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(3000)}
    names = {}
    for key in keys:
        name = encode_key(key)
        check_tensor_name(name, "test")
        assert decode_key(name) == key
        assert names.setdefault(name, key) == key, "two keys share a name"


def test_the_empty_key_is_refused_with_its_reason():
    with pytest.raises(StateDictError, match="empty key"):
        encode_key("")


def _round_trip(value):
    stored, blobs = encode_value("k", value)
    by_name = {b.name: b.data for b in blobs}
    assert blob_names(stored) == [b.name for b in blobs]
    return stored, decode_value(stored, lambda n: by_name[n], "test")


def test_values_keep_their_python_types():
    value = {
        "betas": (0.9, 0.999),
        "size": torch.Size([3, 4]),
        "dtype": torch.bfloat16,
        "tags": {"b", "a"},
        "frozen": frozenset({1}),
        "ints": {0: "zero", 1: "one"},
        "marked": {"$type": "user's own member"},
        "nan": float("nan"),
        "nested": [None, True, 3, "s"],
    }
    stored, back = _round_trip(value)
    assert type(back["betas"]) is tuple and back["betas"] == (0.9, 0.999)
    assert type(back["size"]) is torch.Size and back["size"] == torch.Size([3, 4])
    assert back["dtype"] is torch.bfloat16
    assert back["tags"] == {"a", "b"} and type(back["frozen"]) is frozenset
    assert back["ints"] == {0: "zero", 1: "one"}
    assert back["marked"] == {"$type": "user's own member"}
    assert back["nan"] != back["nan"] and back["nested"] == [None, True, 3, "s"]
    assert stored["tags"] == {"$type": "set", "items": ["a", "b"]}


def test_bytes_and_tensors_inside_a_value_are_blobs_of_raw_bytes():
    buf = io.BytesIO(b"\x80\x04pickle-looking bytes")
    buf.seek(3)
    value = {"raw": b"\x00\xffdata", "ba": bytearray(b"xy"), "buf": buf, "t": (torch.arange(6.0).reshape(2, 3), 1)}
    stored, blobs = encode_value("state", value)
    assert [b.name for b in blobs] == ["state/$0", "state/$1", "state/$2", "state/$3"]
    assert blobs[0].data.dtype == torch.uint8 and blobs[0].data.numpy().tobytes() == b"\x00\xffdata"
    _, back = _round_trip(value)
    assert back["raw"] == b"\x00\xffdata" and type(back["ba"]) is bytearray
    assert back["buf"].getvalue() == buf.getvalue() and back["buf"].tell() == 3
    assert type(back["t"]) is tuple and torch.equal(back["t"][0], value["t"][0]) and back["t"][1] == 1
    assert b"pickle" not in repr(stored).encode()


def test_a_stream_comes_back_byte_for_byte():
    stored, blobs = stream_value("k", b"rot13 bytes")
    back = decode_value(stored, lambda n: blobs[0].data, "test")
    assert isinstance(back, io.BytesIO) and back.getvalue() == b"rot13 bytes"


def test_what_cannot_be_stored_is_refused_naming_the_key():
    with pytest.raises(StateDictError, match="key 'obj': a value of type object cannot be saved"):
        encode_value("obj", {"x": object()})
    loop: list = []
    loop.append(loop)
    with pytest.raises(StateDictError, match="nests more than 100 levels"):
        encode_value("loop", loop)


def test_an_unknown_stored_type_is_a_clear_error():
    with pytest.raises(StateDictError, match="unknown stored value type 'future'"):
        decode_value({"$type": "future"}, lambda n: torch.empty(0), "here")
