"""A foreign pickle's opcodes checked before any of it is unpickled: what it may build is bounded by its size.

The restricted unpicklers of :mod:`~moeckpt.formats.dcp.unpickler` decide *which* objects a pickle may build;
this module bounds *how much*. A pickle is a program for a stack machine, and a few hundred bytes of it can make
CPython's unpickler itself run without bound or crash, before any check of what it built:

* a memo index of 2**30 makes the C unpickler allocate and clear an array of that many entries;
* a tuple nested a million deep, used as a dictionary key, crashes the interpreter (its hash recurses in C);
* memo references push a tuple again for two bytes, so ``t = (t,) * 10`` nine times over is a key whose hash walks
  10**9 elements, and again at every lookup;
* an integer of 5,000 digits cannot be formatted, and one of millions makes every comparison slow.

:func:`scan` walks the opcodes once, without building anything, and refuses a memo index that is not the next one
(every pickler numbers them 0, 1, 2, ...), a tuple or frozenset nested deeper than :data:`MAX_DEPTH` or expanding
(memo references counted as copies) to more than :data:`EXPANSION` elements per byte read before it, MARKs nested
deeper than :data:`MAX_DEPTH`, integers wider than :data:`MAX_INT_BYTES`, more than :data:`MAX_STACK` values on the
stack, and the opcodes DCP never writes (instantiation by ``INST``/``OBJ``, extension codes, out-of-band buffers).

Tuples and frozensets are the values CPython hashes and compares element by element while unpickling (as
dictionary keys and set members). Lists, dictionaries and objects are not followed: nothing walks them during
unpickling (they are unhashable, or hash by identity), CPython's own walks of them (``repr``, ``==``) stop at its
recursion limit, and moeckpt's checks look at one level at a time and show values through
:func:`~moeckpt.formats.render.bounded_repr`. A pickle that passes builds at most one object per opcode: its memory
is bounded by its size, which the reader bounds before reading it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.render import bounded_repr

from . import opcodes


class UnsafePickleError(MoeckptError, ValueError):
    """A pickle in a DCP checkpoint names a class or call outside what DCP writes, or breaks a bound of what DCP
    writes; nothing of it was run. Defined here, below the unpickler that raises it too, so neither imports the
    other's module at run time."""


#: deepest nesting of tuples (DCP's are a level or two: sizes, planner paths) and of MARKs (a few per record).
MAX_DEPTH = 100
#: a tuple may expand to at most this many times the bytes read before it (plus :data:`EXPANSION_SLACK`).
EXPANSION = 4
EXPANSION_SLACK = 4096
#: widest integer: file offsets and lengths fit in 8 bytes (a pickled int takes one more for its sign).
MAX_INT_BYTES = 16
#: longest decimal integer of the text opcodes (protocols 0 and 1).
MAX_INT_DIGITS = 40
#: items on the stack at once (a pickler batches containers by a thousand items).
MAX_STACK = 1_000_000

# the scan's loop compares with module globals: the opcode table's names, bound here once
_ADD, _ARG, _COUNTED, _KIND, _LEAF, _MARK_ADD_SET, _MARK_NEW, _PUT, _REFUSED, _TUPLE_N = (
    opcodes.ADD,
    opcodes.ARG,
    opcodes.COUNTED,
    opcodes.KIND,
    opcodes.LEAF,
    opcodes.MARK_ADD_SET,
    opcodes.MARK_NEW,
    opcodes.PUT,
    opcodes.REFUSED,
    opcodes.TUPLE_N,
)

#: ``read(n)`` returns up to ``n`` more bytes of the pickle, ``b""`` at its end.
Read = Callable[[int], bytes]

_U16 = struct.Struct("<H").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U64 = struct.Struct("<Q").unpack_from

#: the stack is checked against MAX_STACK at least once every this many bytes (it grows by one value a byte at most).
_CHECK_EVERY = 1 << 16
#: most bytes asked of ``read`` at once (a string's length is the file's to claim: it is read in steps).
_READ_AT_MOST = 64 << 20

#: a value that is not a tuple: expanded size 1, nesting 0 (values are coded ``size << 8 | depth``, depth < 256).
_LEAF_CODE = 1 << 8


def scan(
    read: Read,
    where: str,
    *,
    persistent: bool = False,
    chunk: int = 1 << 20,
    initial: bytes | None = None,
    size: int | None = None,
) -> bytes | bytearray:
    """Read a pickle through ``read`` and check its opcodes up to ``STOP``; return its bytes (through ``STOP``).

    Raises :class:`~moeckpt.formats.dcp.unpickler.UnsafePickleError` (one line, with the byte offset) at the first
    opcode that breaks a bound, before the rest is read: garbage is refused after its first bytes. ``persistent``
    admits persistent ids (``torch.save``'s storages); ``.metadata`` has none. ``initial`` is the pickle (or its
    start) when it is already in memory; ``size``, the most bytes it can have (its file's size): a string claiming
    to run past it is refused without reading on. ``read`` is never asked for more than :data:`_READ_AT_MOST`.
    """
    s = _Scan(read, persistent, chunk, initial, size)
    try:
        return s.run()
    except _Refused as e:
        raise UnsafePickleError(
            f"{where}: refusing the pickle at byte {s.pos}: {e}; the file is corrupt or hostile"
        ) from None


class _Refused(Exception):
    """An opcode broke a bound (turned into :class:`UnsafePickleError` with the position by :func:`scan`)."""


class _Scan:
    """The state of one :func:`scan`. Each value on its stack and in its memo is a code ``size << 8 | depth``: the
    expansion and nesting of a tuple or frozenset, ``_LEAF_CODE`` for anything else."""

    def __init__(self, read: Read, persistent: bool, chunk: int, initial: bytes | None, size: int | None) -> None:
        self.read = read
        self.persistent = persistent
        self.chunk = chunk
        self.size = size
        self.buf: bytearray | bytes = bytearray() if initial is None else initial
        self.pos = 0
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.memo: list[int] = []

    # -- input -----------------------------------------------------------------------------------------
    def fill(self, need: int) -> int:
        """Read until ``need`` bytes are buffered or the input ends; the bytes buffered."""
        while len(self.buf) < need:
            got = self.read(min(_READ_AT_MOST, max(self.chunk, need - len(self.buf))))
            if not got:
                break
            if isinstance(self.buf, bytes):
                self.buf = bytearray(self.buf)
            self.buf.extend(got)
        return len(self.buf)

    def more(self, need: int) -> int:
        if self.size is not None and need > self.size:
            raise _Refused(f"an opcode that runs to byte {need}, past the end of the {self.size}-byte file")
        if self.fill(need) < need:
            raise _Refused("it ends early (truncated)")
        return len(self.buf)

    def line(self, start: int) -> bytes:
        """The newline-terminated argument from ``start`` (text opcodes), without its newline."""
        while True:
            end = self.buf.find(b"\n", start)
            if end >= 0:
                return bytes(self.buf[start:end])
            if len(self.buf) - start > 1 << 16:
                raise _Refused("a text argument longer than 64 KiB")
            self.more(len(self.buf) + 1)

    # -- values ----------------------------------------------------------------------------------------
    def tuple_of(self, items: list[int]) -> int:
        """The code of a tuple (or frozenset) of ``items``."""
        size, depth = 1, 0
        for c in items:
            size += c >> 8
            if (c & 0xFF) >= depth:
                depth = (c & 0xFF) + 1
        if depth > MAX_DEPTH:
            raise _Refused(f"tuples nested more than {MAX_DEPTH} deep")
        if size > EXPANSION * self.pos + EXPANSION_SLACK:
            raise _Refused(
                f"a tuple expanding to {size} elements from {self.pos} bytes (memo references: a pickle bomb)"
            )
        return size << 8 | depth

    def fence(self) -> int:
        return self.marks[-1] if self.marks else 0

    def pop(self, k: int) -> list[int]:
        stack = self.stack
        if len(stack) - self.fence() < k:
            raise _Refused("an opcode that takes more values than the stack holds")
        items = stack[len(stack) - k :]
        del stack[len(stack) - k :]
        return items

    def top(self) -> int:
        if len(self.stack) <= self.fence():
            raise _Refused("an opcode that takes a value from an empty stack")
        return self.stack[-1]

    def pop_mark(self) -> list[int]:
        if not self.marks:
            raise _Refused("an opcode that needs a MARK without one")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def put(self, idx: int) -> None:
        # Picklers number memo entries 0, 1, 2, ...: a larger index makes the C unpickler allocate up to it.
        memo = self.memo
        if idx > len(memo):
            raise _Refused(f"memo index {idx} skips past the {len(memo)} entries stored")
        if idx == len(memo):
            memo.append(self.top())
        else:
            memo[idx] = self.top()

    def get(self, idx: int) -> None:
        if not 0 <= idx < len(self.memo):
            raise _Refused(f"a reference to memo entry {idx}, which was never stored")
        self.stack.append(self.memo[idx])

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> bytes | bytearray:
        # This loop runs once per opcode of files of hundreds of MB, so the frequent opcodes are tested first, by
        # value, on local names; the rest go by class (_KIND) or through rare(). One comparison per opcode guards
        # both the buffer's end and the periodic stack check: ``limit`` is the nearer of the two.
        kinds, args = _KIND, _ARG
        stack, memo = self.stack, self.memo
        push, remember, marks = stack.append, memo.append, self.marks
        u32 = _U32
        leaf = _LEAF_CODE
        n = self.fill(self.chunk)
        buf = self.buf
        pos = 0
        fence = 0
        limit = -1
        while True:
            if pos > limit:
                # every _CHECK_EVERY bytes (the stack grows by at most one value a byte) and near the buffer's end
                self.pos = pos
                if len(stack) > MAX_STACK:
                    raise _Refused(f"more than {MAX_STACK} values on the stack at once")
                if pos + 9 > n:  # the longest fixed part of an opcode: itself and 8 argument bytes
                    n = self.fill(pos + 9)
                    buf = self.buf
                    if pos >= n:
                        raise _Refused("it ends before its STOP opcode (truncated)")
                    if pos + 1 + args[buf[pos]] > n:
                        raise _Refused("it ends inside an opcode (truncated)")
                limit = min(n - 9, pos + _CHECK_EVERY)
            op = buf[pos]
            if op == 0x94:  # MEMOIZE
                if len(stack) <= fence:
                    self.pos = pos
                    raise _Refused("MEMOIZE of nothing")
                remember(stack[-1])
                pos += 1
            elif op == 0x6A:  # LONG_BINGET
                idx = u32(buf, pos + 1)[0]
                if idx >= len(memo):
                    self.pos = pos
                    raise _Refused(f"a reference to memo entry {idx}, which was never stored")
                push(memo[idx])
                pos += 5
            elif op == 0x68:  # BINGET
                idx = buf[pos + 1]
                if idx >= len(memo):
                    self.pos = pos
                    raise _Refused(f"a reference to memo entry {idx}, which was never stored")
                push(memo[idx])
                pos += 2
            elif op == 0x8C:  # SHORT_BINUNICODE
                end = pos + 2 + buf[pos + 1]
                if end > n:
                    self.pos = pos
                    n = self.more(end)
                    buf = self.buf
                push(leaf)
                pos = end
            elif op == 0x28:  # MARK
                if len(marks) >= MAX_DEPTH:
                    self.pos = pos
                    raise _Refused(f"MARKs nested more than {MAX_DEPTH} deep")
                fence = len(stack)
                marks.append(fence)
                pos += 1
            elif op == 0x81 or op == 0x52:  # NEWOBJ, REDUCE: a class or callable and its arguments, a new object
                if len(stack) - fence < 2:
                    self.pos = pos
                    raise _Refused("an opcode that takes more values than the stack holds")
                del stack[-2:]
                push(leaf)
                pos += 1
            elif op == 0x62:  # BUILD: a state for the object below it
                if len(stack) - fence < 2:
                    self.pos = pos
                    raise _Refused("an opcode that takes more values than the stack holds")
                stack.pop()
                pos += 1
            elif op == 0x75 or op == 0x65:  # SETITEMS, APPENDS: the items since the MARK, to the value below it
                if not marks:
                    self.pos = pos
                    raise _Refused("an opcode that needs a MARK without one")
                del stack[marks.pop() :]
                fence = marks[-1] if marks else 0
                if len(stack) <= fence:
                    self.pos = pos
                    raise _Refused("items added to nothing")
                pos += 1
            else:
                kind = kinds[op]
                k = args[op]
                if kind == _LEAF:
                    push(leaf)
                    pos += 1 + k
                elif kind == _TUPLE_N:  # TUPLE1, TUPLE2, TUPLE3
                    c = op - 0x84
                    if len(stack) - fence < c:
                        self.pos = pos
                        raise _Refused("an opcode that takes more values than the stack holds")
                    items = stack[-c:]
                    del stack[-c:]
                    self.pos = pos
                    push(self.tuple_of(items))
                    pos += 1
                elif kind == _COUNTED:
                    if k == 1:
                        length = buf[pos + 1]
                    elif k == 4:
                        length = (_I32 if op == 0x54 else u32)(buf, pos + 1)[0]  # BINSTRING's length is signed
                    else:
                        length = _U64(buf, pos + 1)[0]
                    self.pos = pos
                    if length < 0:
                        raise _Refused("a string of negative length")
                    pos += 1 + k + length
                    if pos > n:
                        n = self.more(pos)
                        buf = self.buf
                    push(leaf)
                elif kind == _ADD:  # APPEND (an item), SETITEM (a key and a value): to the container below them
                    c = 2 if op == 0x73 else 1
                    if len(stack) - fence <= c:
                        self.pos = pos
                        raise _Refused("an opcode that takes more values than the stack holds")
                    del stack[-c:]
                    pos += 1
                elif kind == _MARK_ADD_SET:  # ADDITEMS: like SETITEMS (its items, tuples, are bounded when built)
                    if not marks:
                        self.pos = pos
                        raise _Refused("an opcode that needs a MARK without one")
                    del stack[marks.pop() :]
                    fence = marks[-1] if marks else 0
                    if len(stack) <= fence:
                        self.pos = pos
                        raise _Refused("items added to nothing")
                    pos += 1
                elif kind == _MARK_NEW:  # TUPLE, LIST, DICT, FROZENSET: the items since the MARK
                    self.pos = pos
                    items = self.pop_mark()
                    fence = self.fence()
                    push(self.tuple_of(items) if op == 0x74 or op == 0x91 else leaf)
                    pos += 1
                elif kind == _PUT:
                    self.pos = pos
                    self.put(buf[pos + 1] if k == 1 else u32(buf, pos + 1)[0])
                    pos += 1 + k
                elif op == 0x2E:  # STOP
                    self.pos = pos
                    self.pop(1)
                    if pos + 1 < len(buf):  # bytes after STOP are not part of the pickle
                        if isinstance(buf, bytes):
                            return buf[: pos + 1]
                        del buf[pos + 1 :]
                    return buf
                else:
                    self.pos = pos
                    pos = self.rare(op)
                    n = len(self.buf)
                    buf = self.buf
                    fence = self.fence()
                    limit = -1

    def rare(self, op: int) -> int:
        """Check the opcode ``op`` at ``self.pos`` (one DCP rarely or never writes); the position after it."""
        pos, buf = self.pos, self.buf
        if op == 0x80:  # PROTO
            if buf[pos + 1] > 5:
                raise _Refused(f"pickle protocol {buf[pos + 1]}, newer than any Python writes")
            return pos + 2
        if op == 0x95:  # FRAME: its opcodes follow inline
            return pos + 9
        if op == 0x93:  # STACK_GLOBAL: module and name from the stack
            self.pop(2)
            self.stack.append(_LEAF_CODE)
            return pos + 1
        if op == 0x8A or op == 0x8B:  # LONG1, LONG4
            length = buf[pos + 1] if op == 0x8A else _I32(buf, pos + 1)[0]
            if not 0 <= length <= MAX_INT_BYTES:
                raise _Refused(f"an integer of {length} bytes (at most {MAX_INT_BYTES} are read)")
            end = pos + 1 + _ARG[op] + length
            self.more(end)
            self.stack.append(_LEAF_CODE)
            return end
        if op == 0x63:  # GLOBAL: module and name, one line each
            module = self.line(pos + 1)
            name = self.line(pos + 2 + len(module))
            self.stack.append(_LEAF_CODE)
            return pos + 3 + len(module) + len(name)
        if op in _TEXT:  # INT LONG FLOAT STRING UNICODE GET PUT PERSID: one line
            arg = self.line(pos + 1)
            if op in _TEXT_INT and len(arg) > MAX_INT_DIGITS:
                raise _Refused(f"a decimal integer of {len(arg)} characters (at most {MAX_INT_DIGITS} are read)")
            if op == 0x67 or op == 0x70:  # GET, PUT
                try:
                    idx = int(arg)
                except ValueError:
                    raise _Refused(f"memo index {bounded_repr(arg)} is not a number") from None
                self.put(idx) if op == 0x70 else self.get(idx)
            elif op == 0x50 and not self.persistent:  # PERSID
                raise _Refused("a persistent id, which DCP metadata never holds")
            else:
                self.stack.append(_LEAF_CODE)
            return pos + 2 + len(arg)
        if op == 0x51:  # BINPERSID
            if not self.persistent:
                raise _Refused("a persistent id, which DCP metadata never holds")
            self.pop(1)
            self.stack.append(_LEAF_CODE)
            return pos + 1
        if op == 0x92:  # NEWOBJ_EX: class, args, kwargs
            self.pop(3)
            self.stack.append(_LEAF_CODE)
            return pos + 1
        if op == 0x30:  # POP (or, on an empty stack, the topmost MARK)
            if len(self.stack) > self.fence():
                self.stack.pop()
            elif self.marks:
                self.marks.pop()
            else:
                raise _Refused("POP of an empty stack")
            return pos + 1
        if op == 0x31:  # POP_MARK
            self.pop_mark()
            return pos + 1
        if op == 0x32:  # DUP
            self.stack.append(self.top())
            return pos + 1
        if op in _REFUSED:
            raise _Refused(f"opcode {_REFUSED[op]}, which DCP never writes")
        raise _Refused(f"byte 0x{op:02x} is not a pickle opcode")


#: text opcodes of one line: INT, LONG, FLOAT, STRING, UNICODE, GET, PUT, PERSID; those holding an integer.
_TEXT = frozenset(b"ILFSVgpP")
_TEXT_INT = frozenset(b"ILgp")


def scan_bytes(data: bytes | bytearray, where: str, *, persistent: bool = False) -> bytes | bytearray:
    """:func:`scan` of a pickle already in memory (nothing copied when it ends with its ``STOP``)."""
    return scan(lambda k: b"", where, persistent=persistent, initial=bytes(data), size=len(data))
