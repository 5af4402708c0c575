"""The pickle opcodes :mod:`.bounds` tells apart: each opcode's class (what the scan does with it), the bytes of its
fixed-size argument, and the opcodes refused outright. Tables only, so the scan's module holds only the scan."""

from __future__ import annotations

# Opcode classes, in the order the loop tests them (the most frequent in a DCP metadata first).
(
    MEMOIZE,
    GET,
    LEAF,
    COUNTED,
    MARK,
    CALL,
    BUILD,
    TUPLE_N,
    MARK_ADD,
    MARK_ADD_SET,
    MARK_NEW,
    ADD,
    PUT,
    OTHER,
) = range(14)

KIND = [OTHER] * 256
#: argument bytes of each opcode of a fixed-size argument (and of the length prefix of a counted one).
ARG = [0] * 256
for _codes, _kind, _n in (
    (b"\x94", MEMOIZE, 0),
    (b"h", GET, 1),
    (b"j", GET, 4),
    (b"N\x88\x89})]\x8f", LEAF, 0),
    (b"K", LEAF, 1),
    (b"M", LEAF, 2),
    (b"J", LEAF, 4),
    (b"G", LEAF, 8),
    (b"\x8cUC", COUNTED, 1),
    (b"XTB", COUNTED, 4),
    (b"\x8d\x8e\x96", COUNTED, 8),
    (b"(", MARK, 0),
    (b"R\x81", CALL, 0),
    (b"b", BUILD, 0),
    (b"\x85\x86\x87", TUPLE_N, 0),
    (b"eu", MARK_ADD, 0),
    (b"\x90", MARK_ADD_SET, 0),
    (b"tld\x91", MARK_NEW, 0),
    (b"as", ADD, 0),
    (b"q", PUT, 1),
    (b"r", PUT, 4),
):
    for _c in _codes:
        KIND[_c] = _kind
        ARG[_c] = _n

#: what DCP never writes and a bounded reader does not need: class instantiation of protocols 0 and 1 (``INST``,
#: ``OBJ``), the extension registry (``EXT1/2/4``), out-of-band buffers (protocol 5).
REFUSED = {
    ord("i"): "INST",
    ord("o"): "OBJ",
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
    0x97: "NEXT_BUFFER",
    0x98: "READONLY_BUFFER",
}

ARG[ord("\x80")] = 1  # PROTO
ARG[ord("\x95")] = 8  # FRAME
ARG[ord("\x8a")] = 1  # LONG1: the length of its bytes
ARG[ord("\x8b")] = 4  # LONG4
