"""The shared format suite (``moeckpt.testing.BackendTests``), over every backend and every storage."""

from __future__ import annotations

import pytest
import torch

from moeckpt.testing import BackendTests

from ..helpers import toy_tensors


class TestFormatSuite(BackendTests):
    """Every registered backend (``conftest.BACKENDS``: safetensors, zarr and the tests' raw) on local disk,
    memory:// and S3 (moto)."""

    @pytest.fixture
    def backend_name(self, backend) -> str:
        return backend

    @pytest.fixture
    def location(self, storage_url) -> str:
        return storage_url


def test_toy_tensors_have_every_rule_kind():
    rules = {str(sorted(e.sharding.get("tp", {}))) for e in toy_tensors().values()}
    assert {"['dim']", "['blocks', 'dim']", "['dim', 'window']", "[]"} <= rules


def test_tensor_bytes_of_scalars_and_views():
    from moeckpt.formats.pieces import tensor_bytes

    assert bytes(tensor_bytes(torch.tensor(1.5))) == torch.tensor([1.5]).numpy().tobytes()
    assert len(tensor_bytes(torch.tensor(2, dtype=torch.bfloat16))) == 2
    strided = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:3]
    assert bytes(tensor_bytes(strided)) == strided.contiguous().numpy().tobytes()
