"""A second implementation of the moeckpt format, written from docs/format.md alone.

It imports nothing of moeckpt (nor safetensors, zarr or torch): json, struct, math, numpy, xxhash, google_crc32c and,
for the compressed arrays of version 4, numcodecs' blosc decoder (a codec library, not zarr).
It reads checkpoints of versions 1 to 4 on both backends, verifies every checksum it can, and checks what the
spec asks of writers: the version rule, the pieces and writers a sharding defines, the order and bytes of a
safetensors header, the chunk grid and the exact documents of a zarr array, the data-file versions. Wherever the
spec and a checkpoint part, it raises :class:`SpecError` naming the rule. ``tests/formats/test_format_spec.py`` runs it over
checkpoints of every moeckpt writer and compares its values with moeckpt's reader, bit for bit.

Kept deliberately plain (a page of the spec per function, no caching): it is a reference, not a fast path.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from itertools import product

import google_crc32c
import numpy as np
import xxhash
from numcodecs import blosc

KNOWN_VERSIONS = (1, 2, 3, 4, 5)
BACKENDS = ("safetensors", "zarr")
ROLES = ("param", "master", "exp_avg", "exp_avg_sq", "momentum", "buffer")
ZERO_ROLES = ("master", "exp_avg", "exp_avg_sq", "momentum")
STORED = {"pieces": "stored"}
MAX_HEADER = 100_000_000
INNER_LIMIT = 4194304

#: index dtype -> (numpy dtype of the stored bytes, itemsize, safetensors code, zarr data_type, zarr fill_value)
DTYPES: dict[str, tuple[str, int, str, str, object]] = {
    "float64": ("<f8", 8, "F64", "float64", 0.0),
    "float32": ("<f4", 4, "F32", "float32", 0.0),
    "float16": ("<f2", 2, "F16", "float16", 0.0),
    "bfloat16": ("<u2", 2, "BF16", "uint16", 0),
    "float8_e4m3fn": ("u1", 1, "F8_E4M3", "uint8", 0),
    "float8_e5m2": ("u1", 1, "F8_E5M2", "uint8", 0),
    "int64": ("<i8", 8, "I64", "int64", 0),
    "int32": ("<i4", 4, "I32", "int32", 0),
    "int16": ("<i2", 2, "I16", "int16", 0),
    "int8": ("i1", 1, "I8", "int8", 0),
    "uint8": ("u1", 1, "U8", "uint8", 0),
    "bool": ("|b1", 1, "BOOL", "bool", False),
    "uint16": ("<u2", 2, "U16", "uint16", 0),
    "uint32": ("<u4", 4, "U32", "uint32", 0),
    "uint64": ("<u8", 8, "U64", "uint64", 0),
    "complex64": ("<c8", 8, "C64", "complex64", [0.0, 0.0]),
    "complex128": ("<c16", 16, "C128", "complex128", [0.0, 0.0]),
}
#: the dtypes version 3 added ("Versions"): an index of version 1 or 2 holding one breaks the spec.
VERSION_3_DTYPES = ("uint16", "uint32", "uint64", "complex64", "complex128")
#: the values of the index member ``compress`` (version 4); absent means "none".
COMPRESSIONS = ("none", "blosc-zstd")
#: the blosc codec of a compressed zarr chunk ("Compressed arrays"), but for its typesize (the element size).
BLOSC = {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "blocksize": 1048576}


class SpecError(Exception):
    """The checkpoint breaks a rule of docs/format.md (the message names it)."""


def need(ok: object, message: str) -> None:
    if not ok:
        raise SpecError(message)


def checksum(data: bytes) -> str:
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def crc32c(data: bytes) -> bytes:
    return struct.pack("<I", google_crc32c.value(bytes(data)))


def name_crc(name: str) -> int:
    """The CRC-32 (zlib's) of the name's UTF-8 bytes: the seed of the writer rotation."""
    return zlib.crc32(name.encode("utf-8")) & 0xFFFFFFFF


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


# -- the index ---------------------------------------------------------------------------------------------------

_UNSAFE_NAME = re.compile(r"[\\\x00-\x1f\x7f]")


def check_name(name: object) -> str:
    need(isinstance(name, str) and name, f"tensor name {name!r}: must be a non-empty string")
    assert isinstance(name, str)
    need(not name.startswith("/") and not _UNSAFE_NAME.search(name), f"tensor name {name!r} is unsafe")
    need(all(p not in ("", ".", "..") for p in name.split("/")), f"tensor name {name!r} has an empty, . or .. part")
    return name


def check_path(path: object) -> str:
    need(isinstance(path, str) and path, f"file path {path!r}: must be a non-empty string")
    assert isinstance(path, str)
    bad = path.startswith(("/", "\\")) or "\\" in path or ":" in path or "\x00" in path
    need(not bad and all(p not in ("", ".", "..") for p in path.split("/")), f"file path {path!r} is not plain")
    return path


def _is_int(v: object) -> bool:
    return type(v) is int


def _no_nonfinite(value: object, where: str) -> None:
    """NaN and infinities are allowed only in train_state and model.config."""
    if isinstance(value, float):
        need(math.isfinite(value), f"{where}: a non-finite number outside train_state and model.config")
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_nonfinite(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_nonfinite(v, f"{where}[{i}]")


def parse_placement(p: object, ndim: int) -> tuple[str, int, int]:
    """``("R", -1, 1)``, ``("S", d, 1)`` or ``("SS", d, f)``."""
    if p == "R":
        return ("R", -1, 1)
    m = re.fullmatch(r"S\((\d+)\)", p) if isinstance(p, str) else None
    if m:
        d = int(m.group(1))
        need(d < ndim, f"placement {p!r} names dimension {d} of a {ndim}-d tensor")
        return ("S", d, 1)
    m = re.fullmatch(r"SS\((\d+),(\d+)\)", p) if isinstance(p, str) else None
    need(m is not None, f"placement {p!r} is not R, S(d) or SS(d,f)")
    assert m is not None
    d, f = int(m.group(1)), int(m.group(2))
    need(d < ndim and f >= 1, f"placement {p!r}: dimension below {ndim} and factor >= 1 needed")
    return ("SS", d, f)


def _check_rule(sharding: dict, shape: list[int], where: str) -> None:
    need(set(sharding) <= {"tp", "expert_dim"}, f"{where}: a layout rule has only tp and expert_dim")
    ndim = len(shape)
    if "expert_dim" in sharding:
        ed = sharding["expert_dim"]
        need(_is_int(ed) and 0 <= ed < ndim, f"{where}: expert_dim {ed!r}")
    if "tp" in sharding:
        tp = sharding["tp"]
        need(isinstance(tp, dict) and set(tp) <= {"dim", "blocks", "window"}, f"{where}: tp {tp!r}")
        need(_is_int(tp.get("dim")) and 0 <= tp["dim"] < ndim, f"{where}: tp.dim {tp.get('dim')!r}")
        need(not ("blocks" in tp and "window" in tp), f"{where}: blocks and window exclude each other")
        need(tp["dim"] != sharding.get("expert_dim"), f"{where}: tp.dim equals expert_dim")
        if "blocks" in tp:
            b = tp["blocks"]
            need(isinstance(b, list) and all(_is_int(x) and x >= 0 for x in b), f"{where}: blocks {b!r}")
            need(sum(b) == shape[tp["dim"]], f"{where}: blocks {b} do not add up to {shape[tp['dim']]}")
        if "window" in tp:
            w = tp["window"]
            need(isinstance(w, list) and len(w) == 2 and all(_is_int(x) and x >= 0 for x in w), f"{where}: window")


@dataclass
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    param: str
    sharding: dict
    #: "rule", "mesh" or "stored"
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parse_index(raw: bytes) -> dict:
    """The index as a dict, with ``entries`` (name -> Entry) and ``version``; every check of the spec made."""
    doc = json.loads(raw.decode("utf-8"))
    need(isinstance(doc, dict) and doc.get("format") == "moeckpt", 'index: no "format": "moeckpt"')
    version = doc.get("format_version")
    need(_is_int(version), f"index: format_version {version!r} is not an integer")
    need(version in KNOWN_VERSIONS, f"index: format version {version} is not known (1 to 5 are)")
    need(doc.get("backend") in BACKENDS, f"index: backend {doc.get('backend')!r}")
    need(_is_int(doc.get("step")) and doc["step"] >= 0, "index: step")
    layout = doc.get("layout")
    need(isinstance(layout, dict) and all(_is_int(v) and v >= 1 for v in layout.values()), "index: layout")
    model = doc.get("model")
    need(isinstance(model, dict) and isinstance(model.get("arch"), str), "index: model.arch")
    need(isinstance(model.get("config", {}), dict), "index: model.config")
    need(isinstance(doc.get("train_state", {}), dict), "index: train_state")
    for key, value in doc.items():
        if key == "train_state":
            continue
        if key == "model":
            _no_nonfinite({k: v for k, v in value.items() if k != "config"}, "model")
            continue
        _no_nonfinite(value, key)
    meshes = doc.get("meshes", [])
    if version == 1:
        need("meshes" not in doc, "index: version 1 has no meshes")
    if version < 3:
        need("dcp" not in model.get("config", {}), "index: model.config.dcp needs version 3")
    if version < 4:
        need("compress" not in doc, "index: compress needs version 4")
    compress = doc.get("compress", "none")
    need(compress in COMPRESSIONS, f"index: compress {compress!r} is not one of {COMPRESSIONS}")
    need(compress == "none" or doc["backend"] == "zarr", f"index: compress {compress!r} needs backend zarr")
    need(isinstance(meshes, list), "index: meshes must be a list")
    for i, m in enumerate(meshes):
        need(isinstance(m, dict) and set(m) == {"shape", "ranks"}, f"mesh {i}: shape and ranks")
        shape, ranks = m["shape"], m["ranks"]
        need(isinstance(shape, list) and shape and all(_is_int(n) and n >= 1 for n in shape), f"mesh {i}: shape")
        need(isinstance(ranks, list) and len(ranks) == math.prod(shape), f"mesh {i}: rank count")
        need(all(_is_int(r) and r >= 0 for r in ranks) and len(set(ranks)) == len(ranks), f"mesh {i}: ranks")
    tensors, files = doc.get("tensors"), doc.get("files")
    need(isinstance(tensors, dict) and isinstance(files, dict), "index: tensors and files must be objects")
    entries: dict[str, Entry] = {}
    for name, e in tensors.items():
        check_name(name)
        where = f"tensor {name!r}"
        need(isinstance(e, dict), f"{where}: not an object")
        shape = e.get("shape")
        need(isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape), f"{where}: shape {shape!r}")
        need(e.get("dtype") in DTYPES, f"{where}: dtype {e.get('dtype')!r}")
        need(version >= 3 or e["dtype"] not in VERSION_3_DTYPES, f"{where}: dtype {e['dtype']} needs version 3")
        need(e.get("role") in ROLES, f"{where}: role {e.get('role')!r}")
        need(isinstance(e.get("param"), str) and e["param"], f"{where}: param")
        sharding = e.get("sharding", {})
        need(isinstance(sharding, dict), f"{where}: sharding must be an object")
        if sharding == STORED:
            kind = "stored"
        elif "mesh" in sharding:
            kind = "mesh"
            need(set(sharding) == {"mesh", "placements"}, f"{where}: a mesh sharding has mesh and placements only")
            ref = sharding["mesh"]
            need(_is_int(ref) and 0 <= ref < len(meshes), f"{where}: mesh {ref!r} is not in the mesh table")
            placements = sharding["placements"]
            need(
                isinstance(placements, list) and len(placements) == len(meshes[ref]["shape"]),
                f"{where}: one placement per mesh dimension",
            )
            for p in placements:
                parse_placement(p, len(shape))
        else:
            kind = "rule"
            _check_rule(sharding, shape, where)
        entries[name] = Entry(name, tuple(shape), e["dtype"], e["role"], e["param"], sharding, kind)
    for path, f in files.items():
        check_path(path)
        need(isinstance(f, dict) and _is_int(f.get("size")) and f["size"] >= 0, f"file {path!r}: size")
        c = f.get("checksum")
        need(isinstance(c, str) and re.fullmatch(r"xxh3_64:[0-9a-f]{16}", c), f"file {path!r}: checksum {c!r}")
    doc["entries"] = entries
    doc["version"] = version
    doc["compressed"] = compress != "none"
    return doc


def cut_points(entry: Entry) -> tuple[int, list[int]] | None:
    """Checksum slices (version 5): ``(d, cut points)`` of a sliceable tensor, else None."""
    tp = entry.sharding.get("tp") if entry.kind == "rule" else None
    if not isinstance(tp, dict) or "window" in tp or not 0 <= tp["dim"] < len(entry.shape):
        return None
    d = tp["dim"]
    blocks = tp.get("blocks") or [entry.shape[d]]
    k = next((k for k in (8, 4, 2) if all(b % k == 0 for b in blocks)), 1)
    cuts, start = [], 0
    for b in blocks:
        cuts += [start + i * (b // k) for i in range(k)]
        start += b
    return d, sorted(set(cuts))


def slices_of(entry: Entry, offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, list[int]] | None:
    """``(d, sizes)`` of the slices of a stored piece, or None where it is not sliced."""
    found = cut_points(entry)
    if found is None or found[0] == 0:
        return None
    d, cuts = found
    lo, hi = offsets[d], offsets[d] + shape[d]
    inside = [c for c in cuts if lo < c < hi]
    if not inside:
        return None
    edges = [lo, *inside, hi]
    return d, [b - a for a, b in zip(edges, edges[1:])]


def tensor_row_block(entry: Entry) -> int | None:
    """B0 of a tensor cut along dimension 0 (G0 rows, G0 the largest divisor of g that fits in B = 4194304,
    moeckpt's block size), where 4096 <= B0 < B."""
    found = cut_points(entry)
    if found is None or found[0] != 0:
        return None
    g = 0
    for c in found[1]:
        g = math.gcd(g, c)
    row = math.prod(entry.shape[1:]) * DTYPES[entry.dtype][1]
    rows = max((k for k in range(1, g + 1) if g % k == 0 and k * row <= 4194304), default=0) if g and row else 0
    b0 = rows * row
    return b0 if 4096 <= b0 < 4194304 else None


def row_block_of(entry: Entry, offsets: tuple[int, ...], shape: tuple[int, ...]) -> int | None:
    """The row block a writer gives this stored piece, or None."""
    b0 = tensor_row_block(entry)
    if b0 is None:
        return None
    lo, hi = offsets[0], offsets[0] + shape[0]
    return b0 if any(lo < c < hi for c in cut_points(entry)[1]) else None


def sliced_in_layout(entry: Entry, tp: int) -> bool:
    """Sliced, or has row blocks, in a layout of ``tp`` TP ranks."""
    found = cut_points(entry)
    if found is None or not all(entry.shape):
        return False
    d, cuts = found
    if d == 0 and tensor_row_block(entry) is None:
        return False
    n = entry.shape[d]
    if tp == 1:
        intervals = [(0, n)]
    else:
        intervals, start = [], 0
        for b in entry.sharding["tp"].get("blocks") or [n]:
            intervals += [(start + r * (b // tp), start + (r + 1) * (b // tp)) for r in range(tp)]
            start += b
    return any(lo < c < hi for lo, hi in intervals for c in cuts)


def written_version(doc: dict) -> int:
    """The version the spec says a writer gives this index; for an index of an earlier version, the rule of that
    version (a writer before version 5 never wrote 5: its checkpoints of TP-split tensors are version 1)."""
    if (
        doc["version"] >= 5
        and doc["backend"] == "safetensors"
        and any(sliced_in_layout(e, layout_of(doc)[0]) for e in doc["entries"].values())
    ):
        return 5
    if doc["compressed"]:
        return 4
    if "dcp" in doc["model"].get("config", {}) or any(e.dtype in VERSION_3_DTYPES for e in doc["entries"].values()):
        return 3
    if doc.get("meshes") or any(e.kind == "stored" for e in doc["entries"].values()):
        return 2
    return 1


def dcp_keys(doc: dict) -> dict[str, str]:
    """DCP key -> tensor name ("What dcp.save through moeckpt.dcp adds"): in a version-3 index with
    ``model.config.dcp`` every ``%XX`` of a name is a character and the ``$<i>`` parts are blobs of values; in any
    other a name is its own key."""
    names = list(doc["entries"])
    if doc["version"] < 3 or "dcp" not in doc["model"].get("config", {}):
        return {n: n for n in names}
    unescape = lambda n: re.sub(r"%([0-9A-F]{2})", lambda m: chr(int(m.group(1), 16)), n)  # noqa: E731
    return {unescape(n): n for n in names if not any(part.startswith("$") for part in n.split("/"))}


# -- layout rules ------------------------------------------------------------------------------------------------


def layout_of(doc: dict) -> tuple[int, int, int]:
    layout = doc["layout"]
    return layout.get("tp", 1), layout.get("ep", 1), layout.get("dp", 1)


def rule_boxes(entry: Entry, tp: int, ep: int, dp: int, rank: int) -> list[Box]:
    """The boxes rank ``rank`` holds of a tensor with a layout rule, in local order ("Layout rules")."""
    rule = entry.sharding
    shape = list(entry.shape)
    tp_rank, dp_rank = rank % tp, rank // tp
    ep_rank, edp_rank = dp_rank % ep, dp_rank // ep
    offsets, sizes = [0] * len(shape), list(shape)
    if "expert_dim" in rule:
        e = rule["expert_dim"]
        need(shape[e] % ep == 0, f"{entry.name}: ep={ep} does not divide {shape[e]} experts")
        offsets[e], sizes[e] = ep_rank * shape[e] // ep, shape[e] // ep
    boxes: list[tuple[list[int], list[int]]]
    if "tp" not in rule:
        boxes = [(offsets, sizes)]
    else:
        t = rule["tp"]
        d, n = t["dim"], shape[t["dim"]]
        if tp == 1:
            intervals = [(0, n)]
        elif "window" in t:
            offset, total = t["window"]
            need(total % tp == 0, f"{entry.name}: tp={tp} does not divide window total {total}")
            part = total // tp
            lo, hi = max(offset, tp_rank * part), min(offset + n, (tp_rank + 1) * part)
            intervals = [(lo - offset, hi - offset)] if hi > lo else [(0, 0)]
        else:
            blocks = t.get("blocks") or [n]
            intervals, start = [], 0
            for b in blocks:
                need(b % tp == 0, f"{entry.name}: tp={tp} does not divide block {b}")
                p = b // tp
                intervals.append((start + tp_rank * p, start + (tp_rank + 1) * p))
                start += b
        boxes = []
        for a, b in intervals:
            o, s = list(offsets), list(sizes)
            o[d], s[d] = a, b - a
            boxes.append((o, s))
    if entry.role in ZERO_ROLES:
        groups, part = (dp // ep, edp_rank) if "expert_dim" in rule else (dp, dp_rank)
        boxes = _zero_part(boxes, "tp" in rule and rule["tp"]["dim"] == 0, groups, part, len(shape))
    return [(tuple(o), tuple(s)) for o, s in boxes if all(x > 0 for x in s)]


def _zero_part(boxes, concat_rows: bool, groups: int, part: int, ndim: int):
    if ndim == 0:
        return boxes if part == 0 else []
    spans, start = [], 0
    for o, s in boxes:
        if concat_rows:
            spans.append((o, s, start, start + s[0]))
            start += s[0]
        else:
            spans.append((o, s, 0, boxes[0][1][0]))
    n = spans[-1][3] if spans else 0
    c = -(-n // groups)
    lo, hi = min(part * c, n), min((part + 1) * c, n)
    out = []
    for o, s, a, b in spans:
        r0, r1 = max(lo, a), min(hi, b)
        if r1 > r0:
            out.append(([o[0] + r0 - a, *o[1:]], [r1 - r0, *s[1:]]))
    return out


# -- mesh shardings ----------------------------------------------------------------------------------------------


def _chunk(intervals: list[tuple[int, int]], k: int, i: int) -> list[tuple[int, int]]:
    total = sum(b - a for a, b in intervals)
    s = -(-total // k) if total else 0
    lo, hi = min(i * s, total), min((i + 1) * s, total)
    out, pos = [], 0
    for a, b in intervals:
        x, y = max(lo, pos), min(hi, pos + (b - a))
        if y > x:
            out.append((a + x - pos, a + y - pos))
        pos += b - a
    return out


def mesh_boxes(entry: Entry, mesh: dict, position: int) -> list[Box]:
    """The boxes the mesh position ``position`` holds ("Mesh shardings")."""
    mshape = mesh["shape"]
    coord, rest = [], position
    for n in reversed(mshape):
        rest, c = divmod(rest, n)
        coord.append(c)
    coord.reverse()
    if not entry.shape:
        return [((), ())]
    lists = [[(0, n)] if n > 0 else [] for n in entry.shape]
    for m, p in enumerate(entry.sharding["placements"]):
        kind, d, f = parse_placement(p, len(entry.shape))
        k, c = mshape[m], coord[m]
        if kind == "S":
            lists[d] = _chunk(lists[d], k, c)
        elif kind == "SS":
            lists[d] = [iv for j in range(f) for iv in _chunk(_chunk(lists[d], f, j), k, c)]
    if any(not ivs for ivs in lists):
        return []
    return [(tuple(a for a, _ in combo), tuple(b - a for a, b in combo)) for combo in product(*lists)]


# -- pieces and writers ------------------------------------------------------------------------------------------


def expected_pieces(doc: dict, entry: Entry) -> dict[Box, int] | None:
    """The distinct non-empty boxes of a tensor with their writer ranks ("Pieces"); None for stored pieces."""
    holders: dict[Box, list[int]] = {}
    if entry.kind == "stored":
        return None
    if entry.kind == "rule":
        tp, ep, dp = layout_of(doc)
        need(dp % ep == 0, f"layout: ep={ep} does not divide dp={dp}")
        for rank in range(tp * dp):
            for box in rule_boxes(entry, tp, ep, dp, rank):
                holders.setdefault(box, []).append(rank)
        ranks = None
    else:
        mesh = doc["meshes"][entry.sharding["mesh"]]
        for pos in range(len(mesh["ranks"])):
            for box in mesh_boxes(entry, mesh, pos):
                holders.setdefault(box, []).append(pos)
        ranks = mesh["ranks"]
    seed = name_crc(entry.name)
    out = {}
    for i, box in enumerate(sorted(holders, key=lambda b: b[0])):
        h = sorted(holders[box])
        w = h[(seed + i) % len(h)]
        out[box] = w if ranks is None else ranks[w]
    return out


def zarr_grid(shape: tuple[int, ...], boxes) -> tuple[int, ...]:
    """The chunk grid of the zarr backend ("Chunk grid")."""
    out = []
    for d, n in enumerate(shape):
        g = 0
        for offsets, size in boxes:
            for e in (offsets[d], offsets[d] + size[d]):
                if 0 < e < n:
                    g = math.gcd(g, e)
        out.append(g if g else max(n, 1))
    return tuple(out)


def inner_chunks(grid: tuple[int, ...], itemsize: int) -> tuple[int, ...] | None:
    """moeckpt's inner chunk shape, or None for a plain chunk."""
    if not grid or math.prod(grid) * itemsize <= INNER_LIMIT:
        return None
    inner = list(grid)
    for d in range(len(grid)):
        rest = math.prod(grid[d + 1 :]) * itemsize
        if rest <= INNER_LIMIT:
            cap = max(1, INNER_LIMIT // rest)
            inner[d] = max(k for k in range(1, grid[d] + 1) if grid[d] % k == 0 and k <= cap)
            return tuple(inner)
        inner[d] = 1
    return tuple(inner)


_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}


def chunk_codecs(entry: Entry, compressed: bool) -> list:
    """The codecs of one (inner) chunk: bytes and crc32c; compressed, then blosc and crc32c again."""
    if not compressed:
        return [_BYTES, _CRC]
    config = {k: BLOSC[k] for k in ("cname", "clevel", "shuffle")}
    config.update(typesize=DTYPES[entry.dtype][1], blocksize=BLOSC["blocksize"])
    return [_BYTES, _CRC, {"name": "blosc", "configuration": config}, _CRC]


def array_document(
    entry: Entry, grid: tuple[int, ...], inner: tuple[int, ...] | None, compressed: bool = False
) -> bytes:
    chunk = chunk_codecs(entry, compressed)
    codecs: list = chunk
    if inner is not None:
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner),
                    "codecs": chunk,
                    "index_codecs": [_BYTES, _CRC],
                    "index_location": "start",
                },
            }
        ]
    _, _, _, stored, fill = DTYPES[entry.dtype]
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(entry.shape),
        "data_type": stored,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(grid)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": {"moeckpt": {"dtype": entry.dtype, "format_version": 2 if compressed else 1}},
    }
    return json.dumps(doc, indent=2).encode()


def group_document(root: bool) -> bytes:
    attrs = {"moeckpt": {"index": "moeckpt.json", "format_version": 1}} if root else {}
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs}, indent=2).encode()


# -- reading -----------------------------------------------------------------------------------------------------


@dataclass
class Piece:
    tensor: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    #: safetensors: absolute start and length in the file, block size and checksums
    start: int = 0
    length: int = 0
    block: int = 0
    sums: list[str] = field(default_factory=list)
    #: safetensors, version 5: (d, slice sizes) of a sliced piece
    slices: tuple[int, list[int]] | None = None
    #: safetensors: the file's block size (a piece's own, ``block``, differs where it has a row block)
    file_block: int = 0
    #: zarr: the array's chunk grid and inner chunks
    grid: tuple[int, ...] = ()
    inner: tuple[int, ...] | None = None


class Checkpoint:
    """One committed checkpoint, read by the spec: ``pieces`` lists them (headers and documents checked),
    ``tensor`` assembles one (every byte used verified), ``check`` verifies everything the spec says."""

    def __init__(self, path: str):
        self.path = path
        with open(os.path.join(path, "moeckpt.json"), "rb") as f:
            self.doc = parse_index(f.read())
        self.version: int = self.doc["version"]
        self.entries: dict[str, Entry] = self.doc["entries"]
        self.backend: str = self.doc["backend"]
        self._pieces: dict[str, list[Piece]] | None = None

    def _read(self, relpath: str, start: int = 0, end: int | None = None) -> bytes:
        with open(os.path.join(self.path, relpath), "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)

    # listing ---------------------------------------------------------------------------------------------
    def pieces(self) -> dict[str, list[Piece]]:
        if self._pieces is None:
            out: dict[str, list[Piece]] = {n: [] for n in self.entries}
            items = self._st_pieces() if self.backend == "safetensors" else self._zarr_pieces()
            for p in items:
                out[p.tensor].append(p)
            self._pieces = out
        return self._pieces

    def header(self, relpath: str) -> tuple[dict, int]:
        """A safetensors file's header (checked against the index) and where its data starts."""
        entry = self.doc["files"][relpath]
        full = os.path.join(self.path, relpath)
        need(os.path.exists(full), f"{relpath}: listed in the index but missing")
        size = os.path.getsize(full)
        need(size == entry["size"], f"{relpath}: size {size}, the index says {entry['size']}")
        need(size >= 8, f"{relpath}: too short")
        (n,) = struct.unpack("<Q", self._read(relpath, 0, 8))
        need(n <= MAX_HEADER and 8 + n <= size, f"{relpath}: header length {n} is impossible")
        head = self._read(relpath, 0, 8 + n)
        need(checksum(head) == entry["checksum"], f"{relpath}: header checksum differs from the index")
        need(n % 8 == 0, f"{relpath}: header length {n} is not a multiple of 8")
        text = head[8:].decode("utf-8")
        body = text.rstrip(" ")
        doc = json.loads(body, object_pairs_hook=_ordered_pairs)
        need(isinstance(doc, dict) and isinstance(doc.get("__metadata__"), dict), f"{relpath}: no __metadata__")
        return doc, 8 + n

    def _st_pieces(self) -> list[Piece]:
        out = []
        for relpath in self.doc["files"]:
            doc, data_start = self.header(relpath)
            meta = doc["__metadata__"]
            need(all(isinstance(v, str) for v in meta.values()), f"{relpath}: __metadata__ values are strings")
            block_text = meta.get("moeckpt.checksum_block_bytes", "")
            need(block_text.isdigit() and int(block_text) > 0, f"{relpath}: checksum block size {block_text!r}")
            block = int(block_text)
            expect = 0
            keys = [k for k in doc if k != "__metadata__"]
            for key in keys:
                info = doc[key]
                tensor, sep, offs = key.rpartition("@")
                need(sep and tensor, f"{relpath}: key {key!r} is not <name>@<offsets>")
                need(tensor in self.entries, f"{relpath}: piece {key!r} names no tensor of the index")
                entry = self.entries[tensor]
                offsets = tuple(int(o) for o in offs.split(",")) if offs else ()
                need(offs == ",".join(str(o) for o in offsets), f"{relpath}: offsets of {key!r} are not plain decimal")
                need(
                    isinstance(info, dict) and set(info) == {"dtype", "shape", "data_offsets"},
                    f"{relpath}: entry {key!r} needs dtype, shape and data_offsets",
                )
                need(info["dtype"] == DTYPES[entry.dtype][2], f"{relpath}: {key!r} dtype {info['dtype']}")
                shape = tuple(info["shape"])
                need(len(shape) == len(offsets) == len(entry.shape), f"{relpath}: {key!r} rank")
                need(all(o + s <= n for o, s, n in zip(offsets, shape, entry.shape)), f"{relpath}: {key!r} outside")
                length = math.prod(shape) * DTYPES[entry.dtype][1]
                need(length > 0, f"{relpath}: piece {key!r} is empty; empty boxes are never stored")
                start, end = info["data_offsets"]
                need(start == expect and end - start == length, f"{relpath}: {key!r} breaks the order rule")
                expect = end
                sums = meta.get(key, "")
                need(isinstance(sums, str) and sums, f"{relpath}: {key!r} has no checksums")
                sums_list = sums.split(",")
                sliced = None
                piece_block = block
                if key + "#block" in meta:
                    need(self.version >= 5, f"{relpath}: {key!r} has a row block, which needs version 5")
                    text = meta[key + "#block"]
                    need(text.isdigit() and 1 <= int(text) <= block, f"{relpath}: {key!r} row block {text!r}")
                    need(key + "#slices" not in meta, f"{relpath}: {key!r} has both a row block and slices")
                    piece_block = int(text)
                if key + "#slices" in meta:
                    need(self.version >= 5, f"{relpath}: {key!r} has checksum slices, which need version 5")
                    m = re.fullmatch(r"(\d+):(\d+(?:,\d+)+)", meta[key + "#slices"])
                    need(m is not None, f"{relpath}: {key!r} slices {meta[key + '#slices']!r}")
                    d, sizes = int(m.group(1)), [int(w) for w in m.group(2).split(",")]
                    need(
                        1 <= d < len(shape) and min(sizes) >= 1 and sum(sizes) == shape[d], f"{relpath}: {key!r} slices"
                    )
                    sliced = (d, sizes)
                    rows = math.prod(shape[:d])
                    group = max(1, block // (length // rows))
                    need(len(sums_list) == len(sizes) * -(-rows // group), f"{relpath}: {key!r} checksum count")
                else:
                    need(len(sums_list) == -(-length // piece_block), f"{relpath}: {key!r} checksum count")
                need(all(re.fullmatch(r"xxh3_64:[0-9a-f]{16}", s) for s in sums_list), f"{relpath}: {key!r} sums")
                out.append(
                    Piece(
                        tensor,
                        offsets,
                        shape,
                        relpath,
                        data_start + start,
                        length,
                        piece_block,
                        sums_list,
                        sliced,
                        block,
                    )
                )
            need(data_start + expect == self.doc["files"][relpath]["size"], f"{relpath}: data does not fill the file")
            extra = set(meta) - set(keys) - {k + "#slices" for k in keys} - {k + "#block" for k in keys}
            extra -= {"moeckpt.format_version", "moeckpt.checksum_block_bytes"}
            need(not extra, f"{relpath}: __metadata__ has other members {sorted(extra)}")
        return out

    def _zarr_pieces(self) -> list[Piece]:
        out = []
        files = self.doc["files"]
        for relpath, f in files.items():
            raw = self._read(relpath)
            need(len(raw) == f["size"] and checksum(raw) == f["checksum"], f"{relpath}: differs from the index")
        for name, entry in self.entries.items():
            relpath = f"{name}/zarr.json"
            need(relpath in files, f"{relpath}: the array document is not listed in files")
            doc = json.loads(self._read(relpath))
            need(doc.get("node_type") == "array" and doc.get("zarr_format") == 3, f"{relpath}: not a zarr v3 array")
            need(tuple(doc["shape"]) == entry.shape, f"{relpath}: shape differs from the index")
            need(doc["attributes"]["moeckpt"]["dtype"] == entry.dtype, f"{relpath}: dtype differs from the index")
            grid = tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])
            codecs = doc["codecs"]
            inner = None
            if codecs and codecs[0]["name"] == "sharding_indexed":
                inner = tuple(codecs[0]["configuration"]["chunk_shape"])
                need(all(g % i == 0 for g, i in zip(grid, inner)), f"{relpath}: inner chunks do not divide the cell")
            need(len(grid) == len(entry.shape) and all(g >= 1 for g in grid), f"{relpath}: chunk grid {grid}")
            # every writer's document is in one exact form: compare with the one the spec gives for this grid
            compressed = self.doc["compressed"]
            want = array_document(entry, grid, inner, compressed)
            need(self._read(relpath) == want, f"{relpath}: not the spec's array document")
            for cell in product(*(range(-(-n // g)) for n, g in zip(entry.shape, grid))):
                offsets = tuple(c * g for c, g in zip(cell, grid))
                shape = tuple(min(g, n - o) for o, g, n in zip(offsets, grid, entry.shape))
                key = "/".join([name, "c", *(str(c) for c in cell)])
                out.append(Piece(name, offsets, shape, key, grid=grid, inner=inner))
        return out

    # reading ---------------------------------------------------------------------------------------------
    def piece_bytes(self, p: Piece) -> bytes:
        """The piece's bytes (row-major, little-endian), every checksum over them verified."""
        if self.backend == "safetensors":
            data = self._read(p.file, p.start, p.start + p.length)
            need(len(data) == p.length, f"{p.file}: ends early")
            if p.slices is not None:
                self._check_slices(p, data)
                return data
            for k, want in enumerate(p.sums):
                need(checksum(data[k * p.block : (k + 1) * p.block]) == want, f"{p.file}: block {k} of {p.tensor}")
            return data
        return self._cell_bytes(p)

    def _check_slices(self, p: Piece, data: bytes) -> None:
        """Checksum slices (version 5): outer rows in groups, each slice of each group its own checksum."""
        d, sizes = p.slices
        rows = math.prod(p.shape[:d])
        width = p.length // rows
        unit = width // p.shape[d]
        group = max(1, p.block // width)
        groups = -(-rows // group)
        cols = [0]
        for w in sizes:
            cols.append(cols[-1] + w * unit)
        for j in range(len(sizes)):
            for k in range(groups):
                stream = b"".join(
                    data[r * width + cols[j] : r * width + cols[j + 1]]
                    for r in range(k * group, min((k + 1) * group, rows))
                )
                need(checksum(stream) == p.sums[j * groups + k], f"{p.file}: slice {j} group {k} of {p.tensor}")

    def _cell_bytes(self, p: Piece) -> bytes:
        entry = self.entries[p.tensor]
        npdt, item = DTYPES[entry.dtype][0], DTYPES[entry.dtype][1]
        full = os.path.join(self.path, p.file)
        need(os.path.exists(full), f"{p.file}: a cell of a committed checkpoint is missing")
        raw = self._read(p.file)
        grid = p.grid
        size = math.prod(grid) * item
        if self.doc["compressed"]:
            cell = self._compressed_cell(p, raw, npdt, item)
        elif p.inner is None:
            need(len(raw) == size + 4, f"{p.file}: {len(raw)} bytes, expected {size + 4}")
            need(crc32c(raw[:size]) == raw[size:], f"{p.file}: crc32c mismatch")
            cell = np.frombuffer(raw[:size], dtype=npdt).reshape(grid)
        else:
            inner = p.inner
            per = tuple(g // i for g, i in zip(grid, inner))
            m = math.prod(per)
            q = math.prod(inner) * item
            head = 16 * m + 4
            need(len(raw) == head + m * (q + 4), f"{p.file}: {len(raw)} bytes, expected {head + m * (q + 4)}")
            need(crc32c(raw[: 16 * m]) == raw[16 * m : head], f"{p.file}: shard index crc32c mismatch")
            index = struct.unpack(f"<{2 * m}Q", raw[: 16 * m])
            cell = np.empty(grid, dtype=npdt)
            for k, coords in enumerate(np.ndindex(*per)):
                need(index[2 * k : 2 * k + 2] == (head + k * (q + 4), q + 4), f"{p.file}: shard index entry {k}")
                at = head + k * (q + 4)
                chunk = raw[at : at + q]
                need(crc32c(chunk) == raw[at + q : at + q + 4], f"{p.file}: inner chunk {k} crc32c mismatch")
                dst = tuple(slice(c * i, (c + 1) * i) for c, i in zip(coords, inner))
                cell[dst] = np.frombuffer(chunk, dtype=npdt).reshape(inner)
        crop = cell[tuple(slice(0, s) for s in p.shape)]
        return np.ascontiguousarray(crop).tobytes()

    def _compressed_cell(self, p: Piece, raw: bytes, npdt: str, item: int) -> np.ndarray:
        """A compressed cell ("Compressed arrays"): each (inner) chunk is a blosc frame of its bytes and their
        crc32c, then the crc32c of the frame; a shard's index gives the chunks' offsets and lengths."""
        if p.inner is None:
            data = _decode_chunk(raw, math.prod(p.grid) * item, p.file, "chunk")
            return np.frombuffer(data, dtype=npdt).reshape(p.grid)
        inner = p.inner
        per = tuple(g // i for g, i in zip(p.grid, inner))
        m = math.prod(per)
        head = 16 * m + 4
        need(len(raw) >= head, f"{p.file}: {len(raw)} bytes, shorter than its shard index")
        need(crc32c(raw[: 16 * m]) == raw[16 * m : head], f"{p.file}: shard index crc32c mismatch")
        index = struct.unpack(f"<{2 * m}Q", raw[: 16 * m])
        cell = np.empty(p.grid, dtype=npdt)
        at = head
        for k, coords in enumerate(np.ndindex(*per)):
            offset, nbytes = index[2 * k : 2 * k + 2]
            need(offset == at, f"{p.file}: shard index entry {k}: the chunks are not back to back in order")
            chunk = _decode_chunk(raw[at : at + nbytes], math.prod(inner) * item, p.file, f"inner chunk {k}")
            dst = tuple(slice(c * i, (c + 1) * i) for c, i in zip(coords, inner))
            cell[dst] = np.frombuffer(chunk, dtype=npdt).reshape(inner)
            at += nbytes
        need(at == len(raw), f"{p.file}: {len(raw)} bytes, the shard index accounts for {at}")
        return cell

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor as a numpy array of its stored dtype (bfloat16 as uint16, float8 as uint8)."""
        entry = self.entries[name]
        npdt = DTYPES[entry.dtype][0]
        out = np.zeros(entry.shape, dtype=npdt)
        count = np.zeros(entry.shape, dtype=np.int64)
        for p in self.pieces()[name]:
            data = np.frombuffer(self.piece_bytes(p), dtype=npdt).reshape(p.shape)
            where = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.shape))
            out[where] = data
            count[where] += 1
        need(bool((count == 1).all()), f"tensor {name!r}: its pieces do not cover it exactly once")
        return out

    # conformance -----------------------------------------------------------------------------------------
    def check(self, boxes_hint: dict[str, list[Box]] | None = None) -> dict[str, np.ndarray]:
        """Everything the spec asks of a writer; returns every tensor. ``boxes_hint``: the writers' boxes of
        tensors with stored pieces (zarr cannot show them), to check their chunk grids."""
        rule = written_version(self.doc)
        need(self.version == rule, f"index: version {self.version}, the version rule gives {rule}")
        values = {name: self.tensor(name) for name in self.entries}
        if self.backend == "safetensors":
            self._check_safetensors()
        else:
            self._check_zarr(boxes_hint or {})
        return values

    def _check_safetensors(self) -> None:
        for relpath in self.doc["files"]:
            need(re.fullmatch(r"rank-\d{5,}\.safetensors", relpath), f"{relpath}: not a rank file name")
            need(relpath == f"rank-{int(relpath[5:-12]):05d}.safetensors", f"{relpath}: not zero-padded to 5")
            meta = self.header(relpath)[0]["__metadata__"]
            sliced = any(k.endswith("#slices") or k.endswith("#block") for k in meta)
            want_version = "2" if sliced else "1"
            need(
                meta.get("moeckpt.format_version") == want_version,
                f"{relpath}: data-file version is not {want_version}",
            )
        if all(e.kind == "rule" for e in self.entries.values()):
            tp, _, dp = layout_of(self.doc)
            want = {f"rank-{r:05d}.safetensors" for r in range(tp * dp)}
            need(set(self.doc["files"]) == want, "files: every rank of the layout writes its file")
        for name, entry in self.entries.items():
            expected = expected_pieces(self.doc, entry)
            stored = {(p.offsets, p.shape): p.file for p in self.pieces()[name]}
            if expected is None:
                continue
            need(set(stored) == set(expected), f"tensor {name!r}: stored boxes differ from the sharding's")
            for p in self.pieces()[name] if self.version >= 5 else ():  # earlier writers never sliced
                want_slices = slices_of(entry, p.offsets, p.shape)
                need(
                    p.slices == want_slices,
                    f"tensor {name!r} {p.offsets}: slices {p.slices}, the cut points give {want_slices}",
                )
                want_block = row_block_of(entry, p.offsets, p.shape) or p.file_block
                need(
                    p.block == want_block, f"tensor {name!r} {p.offsets}: block {p.block}, the rule gives {want_block}"
                )
            for box, writer in expected.items():
                want_file = f"rank-{writer:05d}.safetensors"
                need(stored[box] == want_file, f"tensor {name!r} box {box}: in {stored[box]}, writer is {want_file}")

    def _check_zarr(self, hints: dict[str, list[Box]]) -> None:
        files = self.doc["files"]
        groups = {""}
        for name in self.entries:
            parts = name.split("/")
            need(not any(p.startswith("__") or p == "zarr.json" for p in parts), f"{name!r}: not a zarr path")
            need(parts[0] != "moeckpt.json" and ":" not in name, f"{name!r}: not a zarr path")
            groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
        need(not (groups & set(self.entries)), "a tensor name is a prefix of another")
        want = {("zarr.json" if g == "" else f"{g}/zarr.json") for g in groups}
        want |= {f"{n}/zarr.json" for n in self.entries}
        need(set(files) == want, f"files: {sorted(set(files) ^ want)[:4]} differ from the documents the spec lists")
        for g in groups:
            path = "zarr.json" if g == "" else f"{g}/zarr.json"
            need(self._read(path) == group_document(g == ""), f"{path}: not the spec's group document")
        for name, entry in self.entries.items():
            expected = expected_pieces(self.doc, entry)
            boxes = list(expected) if expected is not None else hints.get(name)
            if boxes is None:
                continue
            grid = zarr_grid(entry.shape, boxes)
            doc = json.loads(self._read(f"{name}/zarr.json"))
            got = tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])
            need(got == grid, f"tensor {name!r}: chunk grid {got}, the rule gives {grid}")
            inner = inner_chunks(grid, DTYPES[entry.dtype][1]) if entry.shape else None
            want = array_document(entry, grid, inner, self.doc["compressed"])
            need(self._read(f"{name}/zarr.json") == want, f"{name}: inner chunks")


def _decode_chunk(stored: bytes, size: int, file: str, what: str) -> bytes:
    """The ``size`` bytes of one compressed chunk: its frame's crc32c checked, the frame decoded, the decoded
    bytes' crc32c checked."""
    need(len(stored) > 4, f"{file}: {what} has {len(stored)} bytes")
    frame = stored[:-4]
    need(crc32c(frame) == stored[-4:], f"{file}: {what} crc32c mismatch (stored bytes)")
    need(len(frame) >= 16 and struct.unpack_from("<I", frame, 12)[0] == len(frame), f"{file}: {what} frame size")
    try:
        data = blosc.decompress(frame)
    except (RuntimeError, ValueError) as e:
        raise SpecError(f"{file}: {what} is not a blosc frame ({e})") from None
    need(len(data) == size + 4, f"{file}: {what} decodes to {len(data)} bytes, expected {size + 4}")
    need(crc32c(data[:size]) == data[size:], f"{file}: {what} crc32c mismatch (decoded bytes)")
    return data[:size]


def _ordered_pairs(pairs):
    keys = [k for k, _ in pairs]
    need(len(keys) == len(set(keys)), "a JSON object repeats a member")
    return dict(pairs)
