"""The pickle-free writer of plain data for ``torch.load`` (``common.pt`` and ``_extra_state`` of a Megatron export):
what it writes is data only (``torch.load(weights_only=True)`` reads it back equal), and nothing else is taken."""

from __future__ import annotations

import io
import pickletools
import zipfile

import pytest
import torch

from moeckpt.formats.dcp.plain_pickle import dumps, torch_file

VALUES = [
    {},
    [None],
    {"iteration": 7, "args": {"lr": 3e-4, "name": "é\u2603", "flags": [True, False, None]}, "empty": []},
    [0, -1, 2**31 - 1, -(2**31), 2**31, -(2**31) - 1, 2**200, -(2**200), 0.0, -0.0, 1.5, float("inf")],
    {"long": list(range(2500)), "wide": {str(i): i for i in range(1500)}},  # past pickle's batches of 1000
    # what a Megatron optimizer's common state holds: sub-optimizers keyed 0, 1 and AdamW's betas as a tuple
    {"optimizer": {0: {"param_groups": [{"betas": (0.9, 0.95), "fused": None}]}, -1: {}, 2**40: [()]}},
    [(), (1,), (1, "2"), (1, 2, (3,)), (1, 2, 3, 4.0), tuple(range(1200))],  # every tuple opcode, and MARK ... TUPLE
]


@pytest.mark.parametrize(
    "value", VALUES, ids=["empty-dict", "none-list", "nested", "numbers", "long", "int-keys", "tuples"]
)
def test_torch_load_weights_only_reads_it_back(tmp_path, value):
    path = tmp_path / "common.pt"
    path.write_bytes(torch_file(value, "common"))
    got = torch.load(path, weights_only=True)
    assert got == value and repr(got) == repr(value)  # repr: -0.0 stays -0.0, True stays True (not 1)


@pytest.mark.parametrize("value", [VALUES[2], VALUES[5], VALUES[6]], ids=["nested", "int-keys", "tuples"])
def test_only_data_opcodes(value):
    ops = {op.name for op, _, _ in pickletools.genops(dumps(value))}
    assert ops <= {"PROTO", "EMPTY_DICT", "EMPTY_LIST", "MARK", "SETITEMS", "APPENDS", "BINUNICODE", "BININT",
                   "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE", "LONG1", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
                   "TUPLE", "STOP"}  # fmt: skip


def test_the_container_is_torch_saves_and_stored():
    data = torch_file({}, "common")
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        infos = zf.infolist()
        assert {i.filename for i in infos} == {
            "common/data.pkl", "common/.format_version", "common/.storage_alignment", "common/byteorder",
            "common/version", "common/.data/serialization_id",
        }  # fmt: skip
        assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
        assert zf.read("common/data.pkl") == b"\x80\x02}."
    assert torch_file({}, "common") == data  # the same value, the same bytes


def test_nan_is_one_value(tmp_path):
    got = torch.load(io.BytesIO(torch_file([float("nan")])), weights_only=True)
    assert len(got) == 1 and got[0] != got[0]


@pytest.mark.parametrize(
    "value, what",
    [
        ({1, 2}, "set at the top"),
        ({"a": {1.5: 2}}, "key 1.5 at ['a'] is a float"),
        ({True: 2}, "key True at the top is a bool"),
        ({"a": ((1, frozenset()),)}, "frozenset at ['a'][0][1]"),
        ({"t": torch.zeros(1)}, "Tensor at ['t']"),
        ([b"x"], "bytes at [0]"),
        ({"a": [1, {"b": 1j}]}, "complex at ['a'][1]['b']"),
    ],
)
def test_refuses_what_is_not_plain_data(value, what):
    with pytest.raises(TypeError, match="plain_pickle") as e:
        dumps(value)
    assert what in str(e.value)


def test_refuses_an_archive_name_with_a_slash():
    with pytest.raises(ValueError, match="one path component"):
        torch_file({}, "a/b")
