"""benchmarks/plan_scale.py's plot draws whatever was measured: a run without the reference planner
(``--ref-reps 0``) or without timed members still writes its figure."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("matplotlib")

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "plan_scale.py")


def _plan_scale():
    spec = importlib.util.spec_from_file_location("plan_scale", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(*cpu: float) -> list[dict]:
    return [{"wall_s": c, "cpu_s": c} for c in cpu]


def _measured(*cpu: float) -> dict:
    return {"offline_all_writers": _rows(*cpu), "collective_1024": _rows(*cpu), "collective_load_plans": _rows(*cpu)}


@pytest.mark.parametrize(
    "runs, members",
    [
        ({"today": _measured(1.0, 2.0), "before": _measured()}, _rows(0.5)),  # --ref-reps 0
        ({"today": _measured(1.0)}, []),  # no reference series at all, no members timed
        ({"today": _measured(1.0), "before": _measured(3.0)}, _rows(0.5, 0.6)),
    ],
)
def test_plot_draws_what_was_measured(tmp_path, runs, members):
    path = tmp_path / "plan_scale.png"
    _plan_scale().plot(runs, members, str(path))
    assert path.stat().st_size > 0
