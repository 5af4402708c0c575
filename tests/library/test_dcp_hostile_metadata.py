"""A hostile ``.metadata`` ends ``moeckpt import-dcp`` with one line and exit 2, within 10 s and 500 MB.

Memo bombs (a list that expands to 10**9 strings through memo references) in every field a reader looks at,
integers of 5,000 digits and negative ones, a memo index of 2**30, tuples nested 100,000 deep as dictionary keys,
and ``.metadata`` files that are not files (a link to ``/dev/zero``, a FIFO, a directory) or are gigabytes of
zeros. Each case runs in a forked child bounded in memory and time (:mod:`tests.bounded_cli`), so a regression
fails the test instead of taking the machine. The fuzzer at the end does the same for mutations of a real
``.metadata``'s opcodes, sizes and nesting.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import pickle
import pickletools
import shutil
import struct
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from moeckpt.formats.box import Box, covers_exactly_once
from moeckpt.formats.dcp import DcpFormatError, UnsafePickleError, open_dcp, parse_metadata
from moeckpt.formats.dcp import metadata as dcp_metadata

from ..bounded_cli import BoundedCli, Ran
from ..dcp_metadata_builder import TINY_MOE, moe_metadata

# -- building hostile files ------------------------------------------------------------------------------------


def _memo_bomb(depth: int = 9, width: int = 10) -> list:
    """``b = ["lol"]; b = [b] * 10`` nine times: pickled by memo reference, a few hundred bytes; walked, 10**9."""
    b: list = ["lol"]
    for _ in range(depth):
        b = [b] * width
    return b


class _Raw:
    """A place in a pickle that the test writes opcode by opcode (what a hostile writer controls): ``emit(base)``
    returns the opcodes, which may store memo entries ``base``, ``base + 1``, ..., and how many they store."""

    def __init__(self, emit) -> None:
        self.emit = emit


class _RawPickler(pickle._Pickler):  # type: ignore[name-defined]
    """The pure-Python pickler, writing each :class:`_Raw` as its opcodes."""

    def __init__(self, file, protocol: int = 2) -> None:
        super().__init__(file, protocol=protocol)
        self._keep: list[object] = []

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, _Raw):
            ops, stored = obj.emit(len(self.memo))
            self.write(ops)
            for _ in range(stored):  # keep the pickler's memo numbering in step with the unpickler's
                dummy = object()
                self._keep.append(dummy)
                self.memo[id(dummy)] = (len(self.memo), dummy)
            return
        super().save(obj, save_persistent_id)


def _put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)  # LONG_BINPUT


def _get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)  # LONG_BINGET


def _tuple_bomb(depth: int = 10, width: int = 10) -> _Raw:
    """A tuple holding the previous level ``width`` times, ``depth`` levels: its hash walks width**depth items."""

    def emit(base: int) -> tuple[bytes, int]:
        ops = [b"X\x03\x00\x00\x00lol", _put(base), b"0"]
        for i in range(1, depth + 1):
            ops += [b"(", _get(base + i - 1) * width, b"t", _put(base + i), b"0"]
        ops.append(_get(base + depth))
        return b"".join(ops), depth + 1

    return _Raw(emit)


def _list_bomb_raw(depth: int = 9, width: int = 10) -> _Raw:
    def emit(base: int) -> tuple[bytes, int]:
        ops = [b"X\x03\x00\x00\x00lol", _put(base), b"0"]
        for i in range(1, depth + 1):
            ops += [b"]", _put(base + i), b"(", _get(base + i - 1) * width, b"e0"]
        ops.append(_get(base + depth))
        return b"".join(ops), depth + 1

    return _Raw(emit)


def _deep_tuple(levels: int) -> _Raw:
    """``((((...),),),)`` nested ``levels`` deep (hashing it recurses in C)."""
    return _Raw(lambda base: (b")" + b"\x85" * levels, 0))


def _deep_list(levels: int) -> _Raw:
    return _Raw(lambda base: (b"]" * levels + b"a" * (levels - 1), 0))


def _memo_index(index: int) -> _Raw:
    """``None`` stored at memo entry ``index`` (the C unpickler sizes its memo to the index)."""
    return _Raw(lambda base: (b"N" + _put(index), 0))


def _long_int(nbytes: int, negative: bool = False) -> _Raw:
    body = b"\x01" + b"\x00" * (nbytes - 2) + (b"\x80" if negative else b"\x01") if nbytes >= 2 else b"\x01"
    return _Raw(lambda base: (b"\x8b" + struct.pack("<i", len(body)) + body, 0))  # LONG4


@pytest.fixture(scope="module")
def honest_dir(tmp_path_factory) -> str:
    """A real ``dcp.save``: two tensors (one of them chunked by hand below) and two values."""
    path = tmp_path_factory.mktemp("honest") / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a single-process dcp.save warns that it has no process group
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4), "step": 3, "name": "x"}, checkpoint_id=path)
    return str(path)


def _copy(honest_dir: str, dst) -> str:
    shutil.copytree(honest_dir, dst)
    return str(dst)


def _md(ck: str):
    md = FileSystemReader(ck).read_metadata()
    md.storage_meta = None  # its checkpoint id names the original directory
    return md


def _write_md(ck: str, md, raw: bool = False) -> str:
    with open(os.path.join(ck, ".metadata"), "wb") as f:
        (_RawPickler(f).dump if raw else lambda m: pickle.dump(m, f))(md)
    return ck


def _key(md, fqn: str):
    return next(k for k in md.storage_data if k.fqn == fqn)


@pytest.fixture(scope="module")
def cli():
    """``moeckpt`` in bounded children: 500 MB over the forked interpreter, 10 s."""
    worker = BoundedCli(limit_mb=500, timeout_s=10)
    yield worker
    worker.close()


def _assert_one_line(ran: Ran, *, must: str | None = None) -> None:
    assert not ran.timed_out, f"ran past {10} s: {ran}"
    assert ran.ended_in_one_line(), ran
    assert len(ran.stderr) < 1000, f"the message quotes too much: {len(ran.stderr)} characters"
    assert ran.added_mb < 500, ran
    if must is not None:
        assert must in ran.stderr, ran.stderr


# -- bounded rendering ---------------------------------------------------------------------------------------


def test_bounded_repr_never_walks_or_formats_the_whole_value():
    from moeckpt.formats.render import bounded_repr

    class Loud:
        def __repr__(self):  # a stand-in's repr is never called: it would walk what the file built
            raise AssertionError("repr called")

    started = time.perf_counter()
    shown = [bounded_repr(v) for v in (_memo_bomb(), 10**5000, "x" * 10**7, b"\0" * 10**7, {"k": _memo_bomb()})]
    shown.append(bounded_repr([Loud()] * 10**6))
    assert time.perf_counter() - started < 0.5
    assert all(len(s) <= 120 for s in shown), shown
    assert shown[0].startswith("list of 10 items: [[[[")
    assert shown[1] == "an int of 16610 bits"
    assert shown[2].startswith("str of length 10000000: 'xxxx")
    assert shown[5].startswith("list of 1000000 items: [<Loud>, <Loud>")
    assert [bounded_repr(v) for v in ("float32", -3, 1.5, None, True, (1, 2))] == [
        "'float32'",
        "-3",
        "1.5",
        "None",
        "True",
        "(1, 2)",
    ]


# -- defect 1: memo bombs in every field ----------------------------------------------------------------------

_BOMB_SITES = {
    "dtype": lambda md, b: setattr(md.state_dict_metadata["w"].properties, "dtype", b),
    "chunk list": lambda md, b: setattr(md.state_dict_metadata["w"], "chunks", b),
    "a chunk": lambda md, b: md.state_dict_metadata["w"].chunks.__setitem__(0, b),
    "size": lambda md, b: setattr(md.state_dict_metadata["w"], "size", b),
    "chunk offsets": lambda md, b: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", b),
    "chunk sizes": lambda md, b: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", b),
    "relative_path": lambda md, b: md.storage_data.__setitem__(
        _key(md, "w"), _StorageInfo(b, md.storage_data[_key(md, "w")].offset, md.storage_data[_key(md, "w")].length)
    ),
    "item offset": lambda md, b: setattr(md.storage_data[_key(md, "w")], "offset", b),
    "item length": lambda md, b: setattr(md.storage_data[_key(md, "w")], "length", b),
    "transforms": lambda md, b: setattr(md.storage_data[_key(md, "w")], "transform_descriptors", b),
    "storage key name": lambda md, b: object.__setattr__(_key(md, "w"), "fqn", b),
    "storage key offset": lambda md, b: object.__setattr__(_key(md, "w"), "offset", b),
    "layout": lambda md, b: setattr(md.state_dict_metadata["w"].properties, "layout", b),
    "a value's entry": lambda md, b: md.state_dict_metadata.__setitem__("step", b),
}


@pytest.mark.parametrize("site", list(_BOMB_SITES))
def test_a_memo_bomb_anywhere_is_one_bounded_line(cli, honest_dir, tmp_path, site):
    ck = _copy(honest_dir, tmp_path / "ck")
    md = _md(ck)
    _BOMB_SITES[site](md, _memo_bomb())
    _write_md(ck, md)
    assert os.path.getsize(os.path.join(ck, ".metadata")) < 4096
    _assert_one_line(cli.run("import-dcp", ck, tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("where", ["storage_data", "state_dict_metadata"])
def test_a_tuple_bomb_as_a_dictionary_key_is_refused_before_it_is_hashed(cli, honest_dir, tmp_path, where):
    ck = _copy(honest_dir, tmp_path / "ck")
    md = _md(ck)
    getattr(md, where)[_tuple_bomb()] = _StorageInfo("x", 0, 0)
    _write_md(ck, md, raw=True)
    _assert_one_line(cli.run("import-dcp", ck, tmp_path / "dst"), must="pickle bomb")


def _as_key(md, raw: _Raw) -> None:
    md.storage_data[raw] = _StorageInfo("x", 0, 0)


def _as_dtype(md, raw: _Raw) -> None:
    md.state_dict_metadata["w"].properties.dtype = raw


@pytest.mark.parametrize(
    "raw, place, must",
    [
        (_memo_index(2**30), _as_dtype, "memo index 1073741824 skips"),
        (_deep_tuple(100_000), _as_key, "nested more than 100 deep"),
        (_deep_list(100_000), _as_dtype, "the dtype is [[[[[...]]]]]"),
        (_list_bomb_raw(), _as_dtype, "the dtype is list of 10 items"),
        (_long_int(1_000_000), _as_dtype, "an integer of 1000000 bytes"),
    ],
    ids=["memo index 2**30", "tuples 100,000 deep as a key", "lists 100,000 deep", "list bomb", "million-byte int"],
)
def test_bombs_in_the_pickle_itself_are_refused(cli, honest_dir, tmp_path, raw, place, must):
    ck = _copy(honest_dir, tmp_path / "ck")
    md = _md(ck)
    place(md, raw)
    _write_md(ck, md, raw=True)
    _assert_one_line(cli.run("import-dcp", ck, tmp_path / "dst"), must=must)


# -- defect 2: integers out of range ----------------------------------------------------------------------------

_INT_SITES = {
    "item offset": lambda md, v: setattr(md.storage_data[_key(md, "w")], "offset", v),
    "item length": lambda md, v: setattr(md.storage_data[_key(md, "w")], "length", v),
    "chunk offset": lambda md, v: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", torch.Size([v, 0])),
    "chunk size": lambda md, v: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", torch.Size([v, 3])),
    "tensor size": lambda md, v: setattr(md.state_dict_metadata["w"], "size", torch.Size([v, 3])),
    "storage key offset": lambda md, v: object.__setattr__(_key(md, "w"), "offset", torch.Size([v, 0])),
}


@pytest.mark.parametrize(
    "value", [10**5000, -(10**5000), -1, 2**63, 2**64 + 5], ids=["10**5000", "-10**5000", "-1", "2**63", "2**64+5"]
)
@pytest.mark.parametrize("site", list(_INT_SITES))
def test_integers_out_of_range_are_one_line(cli, honest_dir, tmp_path, site, value):
    ck = _copy(honest_dir, tmp_path / "ck")
    md = _md(ck)
    _INT_SITES[site](md, value)
    _write_md(ck, md)
    _assert_one_line(cli.run("import-dcp", ck, tmp_path / "dst"))


@pytest.mark.parametrize(
    "field, value",
    [("offsets", torch.Size([])), ("offsets", torch.Size([0, 0, 0])), ("sizes", torch.Size([2]))],
    ids=["no offsets", "three offsets", "one size"],
)
def test_a_chunk_of_another_rank_than_its_tensor_is_one_line(cli, honest_dir, tmp_path, field, value):
    # found by test_fuzz_hostile_fields: empty offsets of a 2-d chunk raised ValueError from Box, a traceback
    ck = _copy(honest_dir, tmp_path / "ck")
    md = _md(ck)
    setattr(md.state_dict_metadata["w"].chunks[0], field, value)
    _write_md(ck, md)
    _assert_one_line(cli.run("import-dcp", ck, tmp_path / "dst"), must="do not both have the tensor's 2 dimensions")


def test_integers_are_range_checked_by_the_validation_too(honest_dir, tmp_path):
    # 2**63 fits the pickle's integer width (9 bytes); the metadata's own check refuses it before any arithmetic
    ck = _copy(honest_dir, tmp_path / "ck")
    md = _md(ck)
    md.storage_data[_key(md, "w")].offset = 2**63
    _write_md(ck, md)
    with pytest.raises(DcpFormatError, match=r"not an integer from 0 to 2\*\*63 - 1"):
        open_dcp(ck)
    md.storage_data[_key(md, "w")].offset = 2**62
    md.storage_data[_key(md, "w")].length = 2**62
    _write_md(ck, md)
    with pytest.raises(DcpFormatError, match=r"ends past 2\*\*63 - 1"):
        open_dcp(ck)
    md = _md(_copy(honest_dir, tmp_path / "ck2"))
    md.state_dict_metadata["w"].size = torch.Size([2**40, 2**40])
    with pytest.raises(DcpFormatError, match=r"more than 2\*\*63 - 1 elements"):
        parse_metadata(pickle.dumps(md), "test")


# -- defect 3: what .metadata is, and its size, before it is read --------------------------------------------------


@pytest.mark.parametrize("kind", ["link to /dev/zero", "sparse 3 GiB", "just over the cap", "FIFO", "directory"])
def test_metadata_that_is_not_a_small_regular_file_is_refused_unread(cli, honest_dir, tmp_path, kind):
    ck = _copy(honest_dir, tmp_path / "ck")
    path = os.path.join(ck, ".metadata")
    os.unlink(path)
    if kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.truncate(3 * 1024**3 if kind == "sparse 3 GiB" else dcp_metadata.MAX_METADATA_BYTES + 1)
    must = {"FIFO": "is a FIFO", "directory": "is a directory", "link to /dev/zero": "is a character device"}
    ran = cli.run("import-dcp", ck, tmp_path / "dst")
    _assert_one_line(ran, must=must.get(kind, "larger than any DCP metadata"))
    assert ran.added_mb < 50, ran


def test_a_large_file_of_garbage_is_refused_after_its_first_bytes(cli, honest_dir, tmp_path):
    ck = _copy(honest_dir, tmp_path / "ck")
    with open(os.path.join(ck, ".metadata"), "wb") as f:
        f.truncate(900 * 1024**2)  # under the cap, all zeros: not a pickle from its first byte
    ran = cli.run("import-dcp", ck, tmp_path / "dst")
    _assert_one_line(ran, must="at byte 0")
    assert ran.added_mb < 50, ran


def test_object_store_metadata_is_sized_before_it_is_read(honest_dir, monkeypatch):
    import fsspec

    from moeckpt.formats.storages.url import FsspecStorage

    url = f"memory://hostile-metadata-{os.getpid()}/ck"
    fs = fsspec.filesystem("memory")
    for name in os.listdir(honest_dir):
        with open(os.path.join(honest_dir, name), "rb") as f:
            fs.pipe(f"{url}/{name}", f.read())
    reads: list[tuple[str, int, int]] = []
    original = FsspecStorage.read_range

    def counting(self, relpath, start, end):
        reads.append((relpath, start, end))
        return original(self, relpath, start, end)

    monkeypatch.setattr(FsspecStorage, "read_range", counting)
    assert set(open_dcp(url).tensors) == {"w", "b"}
    assert reads[0] == (".metadata", 0, os.path.getsize(os.path.join(honest_dir, ".metadata")))
    reads.clear()
    monkeypatch.setattr(dcp_metadata, "MAX_METADATA_BYTES", 100)
    monkeypatch.setattr("moeckpt.formats.dcp.reader.MAX_METADATA_BYTES", 100)
    with pytest.raises(DcpFormatError, match="larger than any DCP metadata"):
        open_dcp(url)
    assert reads == []  # refused from the size alone
    fs.rm(url, recursive=True)


# -- the pickle scan does not refuse honest files -------------------------------------------------------------------


def test_a_many_rank_metadata_passes_every_bound_in_every_protocol():
    from moeckpt.formats.dcp import bounds

    md = moe_metadata(TINY_MOE, 16)
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(md, protocol=protocol)
        assert bounds.scan_bytes(data, "test") == data
        parsed = parse_metadata(data, "test")
        assert len(parsed.tensors) == sum(1 for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))


def test_the_scan_reads_no_further_than_the_first_bad_opcode():
    from moeckpt.formats.dcp import bounds

    given_bytes = []

    def read(n: int) -> bytes:
        given_bytes.append(n)
        return b"\x80\x04\x95" + b"\x00" * 8 + b"\xff" * (n - 11) if len(given_bytes) == 1 else b"\xff" * n

    with pytest.raises(UnsafePickleError, match="at byte 11: byte 0xff is not a pickle opcode"):
        bounds.scan(read, "test", chunk=4096)
    assert given_bytes == [4096]


def test_the_scan_bounds_the_stack_marks_and_memo():
    from moeckpt.formats.dcp import bounds

    cases = {
        b"\x80\x04" + b"N" * (bounds.MAX_STACK + 70_000) + b".": "values on the stack",
        b"\x80\x04" + b"(" * 200 + b"N.": "MARKs nested more than 100 deep",
        b"\x80\x02Nq\x05.": "memo index 5 skips past the 0 entries",
        b"\x80\x02h\x00.": "memo entry 0, which was never stored",
        b"\x80\x02\x8a\x11" + b"\x01" * 17 + b".": "an integer of 17 bytes",
        b"\x80\x02X\xff\xff\xff\x7f.": "past the end of the 8-byte file",
        b"\x80\x02ccopyreg\n_reconstructor\n)\x81N.": None,  # fine for the scan: find_class refuses it later
        b"\x80\x02\x82\x01.": "opcode EXT1",
        b"\x80\x02Ncos\nsystem\n(Vx\nto.": "opcode OBJ",
    }
    for data, must in cases.items():
        if must is None:
            bounds.scan_bytes(data, "test")
            continue
        with pytest.raises(UnsafePickleError, match=must):
            bounds.scan_bytes(data, "test")


# -- chunk covers: linear in the chunks ----------------------------------------------------------------------------


def test_many_chunks_along_one_dimension_are_checked_in_linear_time(honest_dir, tmp_path):
    # 6,000 chunks side by side along dim 1: the pairwise check took a minute; the grid check is linear
    ck = _copy(honest_dir, tmp_path / "ck")
    md = _md(ck)
    n = 6000
    t = md.state_dict_metadata["w"]
    t.size = torch.Size([2, n])
    info = md.storage_data.pop(_key(md, "w"))
    t.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, i]), sizes=torch.Size([2, 1])) for i in range(n)]
    for i in range(n):
        md.storage_data[MetadataIndex("w", torch.Size([0, i]))] = _StorageInfo(info.relative_path, 0, 8)
    started = time.process_time()
    parsed = parse_metadata(pickle.dumps(md), "test")
    assert len(parsed.tensors["w"].chunks) == n
    assert time.process_time() - started < 5
    t.chunks[5] = ChunkStorageMetadata(offsets=torch.Size([0, 4]), sizes=torch.Size([2, 1]))  # 4 twice, 5 never
    md.storage_data[MetadataIndex("w", torch.Size([0, 4]))] = _StorageInfo(info.relative_path, 0, 8)
    with pytest.raises(DcpFormatError, match="cover it exactly once"):
        parse_metadata(pickle.dumps(md), "test")


@st.composite
def _tilings(draw):
    """Boxes of a small 2- or 3-d tensor: a grid tiling, then maybe a box removed, duplicated, moved or split."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    cuts = [sorted(draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3)) | {0, n}) for n in shape]
    boxes = []
    for lo_hi in itertools.product(*[list(zip(c, c[1:])) for c in cuts]):
        boxes.append(Box(tuple(a for a, _ in lo_hi), tuple(b - a for a, b in lo_hi)))
    action = draw(st.sampled_from(["keep", "drop", "dup", "move", "grow"]))
    i = draw(st.integers(0, len(boxes) - 1))
    if action == "drop":
        boxes.pop(i)
    elif action == "dup":
        boxes.append(boxes[i])
    elif action in ("move", "grow"):
        b = boxes[i]
        d = draw(st.integers(0, ndim - 1))
        offsets, sizes = list(b.offsets), list(b.shape)
        if action == "move" and offsets[d] > 0:
            offsets[d] -= 1
        elif action == "grow" and offsets[d] + sizes[d] < shape[d]:
            sizes[d] += 1
        boxes[i] = Box(tuple(offsets), tuple(sizes))
    return shape, boxes


@settings(max_examples=300, deadline=None, database=None)
@given(_tilings())
def test_the_grid_cover_check_agrees_with_the_pairwise_one(case):
    shape, boxes = case
    boxes = [b for b in boxes if not b.is_empty()]
    assert (dcp_metadata._cover_problem(shape, boxes) is None) == (covers_exactly_once(shape, boxes) is None)


def test_a_large_irregular_set_of_chunks_is_refused_not_compared_pairwise():
    # a staircase: every chunk starts a new row and a new column, so its grid has n**2 cells
    n = 3000
    boxes = [Box((i, i), (1, n - i)) for i in range(n)]
    started = time.process_time()
    problem = dcp_metadata._cover_problem((n, n), boxes)
    assert problem is not None and "do not form a grid" in problem
    assert time.process_time() - started < 2


# -- the fuzzer --------------------------------------------------------------------------------------------------

#: hostile fragments, spliced at opcode boundaries of a real .metadata or set as one of its fields
_FRAGMENT = st.one_of(
    st.builds(_list_bomb_raw, st.integers(1, 14), st.integers(2, 30)),
    st.builds(_tuple_bomb, st.integers(1, 14), st.integers(2, 30)),
    st.builds(_deep_tuple, st.integers(1, 300_000)),
    st.builds(_deep_list, st.integers(1, 300_000)),
    st.builds(_memo_index, st.integers(0, 2**32 - 1)),
    st.builds(lambda i: _Raw(lambda base: (_get(i), 0)), st.integers(0, 2**32 - 1)),
    st.builds(_long_int, st.integers(1, 200_000), st.booleans()),
    st.builds(
        lambda op, n: _Raw(lambda base: (op + n, 0)),
        st.sampled_from([b"X", b"B", b"T"]),
        st.integers(0, 2**32 - 1).map(lambda v: struct.pack("<I", v)),
    ),
    st.builds(
        lambda op, n: _Raw(lambda base: (op + n, 0)),
        st.sampled_from([b"\x8d", b"\x8e", b"\x96", b"\x95"]),
        st.integers(0, 2**64 - 1).map(lambda v: struct.pack("<Q", v)),
    ),
    st.binary(min_size=1, max_size=64).map(lambda b: _Raw(lambda base: (b, 0))),
    st.integers(-(2**200), 2**200),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.binary(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=4), inner)
        ),
        max_leaves=20,
    ),
)

_FIELDS = [*_BOMB_SITES, "version", "planner_data", "the whole metadata"]


def _place(md, field: str, value) -> object:
    """``md`` with ``value`` in ``field`` (or ``value`` alone, for the whole metadata)."""
    if field == "version":
        md.version = value
    elif field == "planner_data":
        md.planner_data = {"w": value}
    elif field == "the whole metadata":
        return value
    else:
        _BOMB_SITES[field](md, value)
    return md


def _opcodes(data: bytes) -> list[tuple[int, int]]:
    """``(position, memo entries stored before it)`` of every opcode of a pickle."""
    out, stored = [], 0
    for op, _, pos in pickletools.genops(data):
        out.append((pos, stored))
        stored += op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT")
    return out


def _run_case(cli: BoundedCli, honest_dir: str, root, data: bytes) -> Ran:
    ck = root / "ck"
    shutil.copytree(honest_dir, ck)
    with open(ck / ".metadata", "wb") as f:
        f.write(data)
    ran = cli.run("import-dcp", ck, root / "dst")
    shutil.rmtree(root, ignore_errors=True)
    assert ran.rc == 0 or ran.ended_in_one_line(), ran
    assert not ran.timed_out and ran.wall_s < 10 and ran.added_mb < 500, ran
    return ran


@pytest.mark.slow
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(_FIELDS), value=_FRAGMENT, protocol=st.sampled_from([2, 4]))
def test_fuzz_hostile_fields(cli, honest_dir, tmp_path_factory, field, value, protocol):
    buf = io.BytesIO()
    _RawPickler(buf, protocol).dump(_place(_md(honest_dir), field, value))
    _run_case(cli, honest_dir, tmp_path_factory.mktemp("fuzz"), buf.getvalue())


@pytest.mark.slow
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_opcodes_of_a_real_metadata(cli, honest_dir, tmp_path_factory, data):
    with open(os.path.join(honest_dir, ".metadata"), "rb") as f:
        raw = f.read()
    ops = _opcodes(raw)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        if not raw:  # truncated to nothing: an empty .metadata is the case; no byte is left to edit
            break
        edit = data.draw(st.sampled_from(["splice", "flip", "delete", "truncate", "repeat"]), label="edit")
        at, stored = data.draw(st.sampled_from(ops), label="at")
        if edit == "splice":  # a hostile fragment between two opcodes, numbering its memo entries after theirs
            fragment = data.draw(_FRAGMENT.filter(lambda v: isinstance(v, _Raw)), label="fragment")
            raw = raw[:at] + fragment.emit(stored)[0] + raw[at:]
        elif edit == "repeat":  # a run of opcodes many times over: memo references, marks, containers
            end = data.draw(st.integers(at, min(len(raw), at + 32)), label="end")
            raw = raw[:at] + raw[at:end] * data.draw(st.integers(2, 5000), label="times") + raw[end:]
        elif edit == "flip":
            i = data.draw(st.integers(0, len(raw) - 1), label="byte")
            raw = raw[:i] + bytes([data.draw(st.integers(0, 255), label="value")]) + raw[i + 1 :]
        elif edit == "delete":
            i = data.draw(st.integers(0, len(raw) - 1), label="from")
            raw = raw[:i] + raw[i + data.draw(st.integers(1, 64), label="count") :]
        else:
            raw = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)), label="length")]
        ops = [(p, m) for p, m in ops if p < len(raw)] or [(0, 0)]
    _run_case(cli, honest_dir, tmp_path_factory.mktemp("fuzz"), raw)


def test_numbers_quoted_from_metadata_stay_short():
    # every integer a message may quote is at most 2**63 - 1 once validated: 19 digits
    assert len(str(dcp_metadata.MAX_INT)) == 19 and math.log2(dcp_metadata.MAX_INT + 1) == 63
