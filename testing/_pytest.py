"""pytest, for the contract suites: imported here once, so that its absence is one line saying what to install."""

from __future__ import annotations

try:
    import pytest
except ImportError as e:  # the suites are pytest classes; the rest of moeckpt.testing needs no pytest
    raise ImportError(
        "moeckpt.testing's BackendTests and StorageTests are pytest suites: install pytest (pip install pytest)"
    ) from e

__all__ = ["pytest"]
