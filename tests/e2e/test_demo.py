"""The README's main job, `moeckpt demo`, runs end to end and reports every step ok (the run is shared with
tests/e2e/test_elastic_agents.py through the session's ``demo_run`` fixture: the drill runs once in the suite)."""

from __future__ import annotations

import os

import pytest

from ..proc_helpers import run_python_without

pytestmark = pytest.mark.slow  # multi-process


def test_demo_runs(demo_run):
    code, out, err, root = demo_run
    assert code == 0, out + err
    assert "moeckpt demo summary" in out
    assert "FAIL " not in out.split("moeckpt demo summary")[1]
    assert f"working in {root}" in out  # it says where it keeps its files
    assert (root / "loss.png").stat().st_size > 10_000  # the README's first command draws the picture
    assert "skipped" not in out.split("moeckpt demo summary")[1]


#: the ``plot`` extra alone (matplotlib; transformers, pytest and moto unimportable, as in such an install) draws a
#: drill's loss curve (tests/e2e/test_install.py holds the other extras' rules).
_PLOT_EXTRA_ALONE = r"""
import json
from moeckpt.trainer.elastic_drill import DrillResult, plot_drill
with open(sys.argv[1]) as f:
    plot_drill(DrillResult.from_json(json.load(f)), sys.argv[2])
"""


def test_the_plot_extra_alone_draws_the_demo_s_drill(demo_run, tmp_path):
    root = demo_run[3]
    out = tmp_path / "drill.png"
    p = run_python_without(
        ("pytest", "_pytest", "transformers", "moto"), _PLOT_EXTRA_ALONE, str(root / "drill.json"), str(out)
    )
    assert p.returncode == 0, p.stderr[-3000:]
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, len(data)


def test_the_drill_files_run_on_one_worker(request):
    """Under xdist the drill files carry the group tests/conftest.py gives them, so they share one worker (and one
    demo run); with a pytest whose node ids xdist cannot extend (9.2), the group was silently dropped."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        pytest.skip("not run under xdist")
    assert request.node.nodeid.endswith("@drills"), request.node.nodeid
