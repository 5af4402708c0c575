"""xxh3-64 of a long input in two parts: its accumulators (the bulk of the work, which a device can do) and its
digest (a few operations on the host).

A checksum block's xxh3-64 (:mod:`.checksum`, seed 0, the default secret) over more than
:data:`LONG_INPUT_BYTES` bytes runs eight 64-bit accumulators over the input's 64-byte stripes, scrambling them
after every 1,024 bytes, and ends with a merge and an avalanche of them. This module states that split as the
xxHash specification defines it, so that a device load (:mod:`moeckpt.reshard.device_checks`) can hash the bytes
it has landed in device memory and compare the result with the checksums the index records, bit for bit the same
digest: :func:`accumulators` is the host reference of what the device computes, :func:`digest` finishes either.
"""

from __future__ import annotations

import numpy as np

from .checksum import ALGORITHM

#: inputs of at most this many bytes take xxh3's short-input paths, not the accumulators: they are hashed on the host
LONG_INPUT_BYTES = 240
#: bytes of input between two scrambles of the accumulators (16 stripes of 64 bytes)
SCRAMBLE_BYTES = 1024

#: xxh3's default secret (192 bytes), from the xxHash specification
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)

_M64 = (1 << 64) - 1
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3, _P64_4, _P64_5 = (
    0x9E3779B185EBCA87,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0x85EBCA77C2B2AE63,
    0x27D4EB2F165667C5,
)


def _word(offset: int) -> int:
    return int.from_bytes(SECRET[offset : offset + 8], "little")


#: the accumulators' starting values
INIT = (_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1)
#: the secret words each of a block's 16 stripes is keyed with, stripe by stripe (16 x 8)
STRIPE_KEYS = tuple(tuple(_word(8 * stripe + 8 * lane) for lane in range(8)) for stripe in range(16))
#: the key of the input's last 64 bytes
LAST_KEYS = tuple(_word(len(SECRET) - 64 - 7 + 8 * lane) for lane in range(8))
#: the key of every scramble
SCRAMBLE_KEYS = tuple(_word(len(SECRET) - 64 + 8 * lane) for lane in range(8))
#: what each scramble multiplies by
SCRAMBLE_PRIME = _P32_1


def _stripes(words: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The accumulators' increments from stripes ``words`` (n x 8 little-endian words) keyed with ``keys``."""
    keyed = words ^ keys
    products = (keyed & np.uint64(0xFFFFFFFF)) * (keyed >> np.uint64(32))
    swapped = words[:, [1, 0, 3, 2, 5, 4, 7, 6]]  # each lane also takes its neighbour's word, unkeyed
    return products.sum(axis=0, dtype=np.uint64) + swapped.sum(axis=0, dtype=np.uint64)


def accumulators(data: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """The eight accumulators of xxh3-64 over ``data`` (more than :data:`LONG_INPUT_BYTES` bytes), before the
    merge: the host reference of a device's computation."""
    mv = memoryview(data).cast("B")
    n = len(mv)
    if n <= LONG_INPUT_BYTES:
        raise ValueError(f"accumulators: xxh3 hashes {n} bytes (at most {LONG_INPUT_BYTES}) without them")
    keys = np.array(STRIPE_KEYS, dtype=np.uint64)
    scramble = np.array(SCRAMBLE_KEYS, dtype=np.uint64)
    acc = np.array(INIT, dtype=np.uint64)
    blocks = (n - 1) // SCRAMBLE_BYTES
    whole = np.frombuffer(mv[: blocks * SCRAMBLE_BYTES], dtype="<u8").reshape(blocks, 16, 8)
    with np.errstate(over="ignore"):
        for block in whole:
            acc = acc + _stripes(block, keys)
            acc ^= acc >> np.uint64(47)
            acc ^= scramble
            acc *= np.uint64(SCRAMBLE_PRIME)
        at = blocks * SCRAMBLE_BYTES
        stripes = (n - 1 - at) // 64
        if stripes:
            tail = np.frombuffer(mv[at : at + 64 * stripes], dtype="<u8").reshape(stripes, 8)
            acc = acc + _stripes(tail, keys[:stripes])
        last = np.frombuffer(mv[n - 64 :], dtype="<u8").reshape(1, 8)
        acc = acc + _stripes(last, np.array([LAST_KEYS], dtype=np.uint64))
    return tuple(int(a) for a in acc)


def digest(acc: tuple[int, ...] | list[int], nbytes: int) -> int:
    """xxh3-64 of ``nbytes`` bytes (more than :data:`LONG_INPUT_BYTES`) from their eight accumulators: the merge
    and the avalanche."""
    result = (nbytes * _P64_1) & _M64
    for i in range(4):
        product = (acc[2 * i] ^ _word(11 + 16 * i)) * (acc[2 * i + 1] ^ _word(11 + 16 * i + 8))
        result = (result + ((product & _M64) ^ (product >> 64))) & _M64
    result ^= result >> 37
    result = (result * 0x165667919E3779F9) & _M64
    return result ^ (result >> 32)


def checksum_of(acc: tuple[int, ...] | list[int], nbytes: int) -> str:
    """The recorded form of :func:`digest` (what :func:`~.checksum.checksum` of the same bytes returns)."""
    return f"{ALGORITHM}:{digest(acc, nbytes):016x}"
