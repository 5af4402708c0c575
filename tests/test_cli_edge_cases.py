"""CLI edge cases: 0-d tensors in ``diff``, malformed model configs, the zarr doc snippet, honest stored sizes."""

from __future__ import annotations

import torch

from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.save import save_full_tensors


def _save_with_scalar(location: str, backend: str, scalar: float) -> None:
    tensors = {
        "scale": TensorEntry(name="scale", shape=(), dtype="float32", role="buffer", param="scale"),
        "w": TensorEntry(name="w", shape=(4, 3), dtype="float32", role="buffer", param="w"),
    }
    values = {"scale": torch.tensor(scalar, dtype=torch.float32), "w": torch.arange(12, dtype=torch.float32).reshape(4, 3)}
    save_full_tensors(location, tensors=tensors, layout=Layout(dp=2), values=lambda e: values[e.name],
                      model={"arch": "toy", "config": {}}, backend=backend)


def test_diff_compares_scalar_tensors_bitwise(tmp_path, backend, moeckpt_cli):
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    _save_with_scalar(a, backend, 1.5)
    _save_with_scalar(b, backend, 1.5)
    _save_with_scalar(c, backend, 2.0)
    code, out, err = moeckpt_cli("diff", a, a)
    assert code == 0 and "identical: 2 tensors" in out, (out, err)
    code, out, err = moeckpt_cli("diff", a, b)
    assert code == 0 and "Traceback" not in err, (out, err)
    code, out, err = moeckpt_cli("diff", a, c)
    assert code == 1, (out, err)
    assert out.splitlines() == ["scale: max abs diff 0.5"]
    assert "1 tensor(s) differ" in err
    # a NaN scalar equals itself bit for bit
    n1, n2 = str(tmp_path / "n1"), str(tmp_path / "n2")
    _save_with_scalar(n1, backend, float("nan"))
    _save_with_scalar(n2, backend, float("nan"))
    assert moeckpt_cli("diff", n1, n2)[0] == 0
