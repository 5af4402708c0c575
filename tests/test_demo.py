"""The README's main job, `moeckpt demo`, runs end to end and reports every step ok."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # multi-process


def test_demo_runs(tmp_path, moeckpt_cli):
    code, out, err = moeckpt_cli("demo", "--dir", str(tmp_path / "demo"))
    assert code == 0, out + err
    assert "moeckpt demo summary" in out
    assert "FAIL " not in out.split("moeckpt demo summary")[1]
