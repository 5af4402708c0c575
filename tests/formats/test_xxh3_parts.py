"""xxh3-64 split into accumulators and digest gives the digest xxhash gives, for every long input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeckpt.formats.checksum import checksum
from moeckpt.formats.xxh3_parts import LONG_INPUT_BYTES, SCRAMBLE_BYTES, accumulators, checksum_of


@settings(max_examples=60, deadline=None)
@given(n=st.integers(LONG_INPUT_BYTES + 1, 6 * SCRAMBLE_BYTES + 70), seed=st.integers(0, 2**32 - 1))
def test_accumulators_and_digest_equal_xxh3_64(n, seed):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert checksum_of(accumulators(data), n) == checksum(data)


@pytest.mark.parametrize("n", [4 * 1024 * 1024, 4 * 1024 * 1024 - 3, 1024, 1025, 1088, 2049])
def test_block_edges_and_a_whole_checksum_block(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert checksum_of(accumulators(data), n) == checksum(data)


def test_short_inputs_are_refused():
    with pytest.raises(ValueError, match="240"):
        accumulators(bytes(LONG_INPUT_BYTES))
