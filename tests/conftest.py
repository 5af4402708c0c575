"""Shared fixtures: the storages every format test runs over (local directory, memory://, and S3 via moto)."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

from moeckpt.formats.backend import backend_names

from . import raw_backend  # noqa: F401  (registers the tests' third format, "raw")
from .s3_fixtures import moto_endpoint, s3_url  # noqa: F401  (fixtures: S3 via moto's server mode)

_counter = itertools.count()

#: the tests folder: the groups below name files by their path in it (``e2e/test_demo.py``).
TESTS = Path(__file__).resolve().parent

#: test files whose tests run on one xdist worker, in order: they share the session's demo run (``demo_run``),
#: or time failures (killed nodes, signals, heartbeats) that a second drill beside them on 2 cores would skew.
SERIAL_FILES = {"e2e/test_demo.py", "e2e/test_elastic_agents.py", "e2e/test_signals.py", "trainer/test_memory_tier.py"}


#: test files whose module fixture is a training run of tens of seconds (torchtitan's): their tests run on one
#: worker, so that the run is made once, not once per worker (a group per file: the files still run side by side).
SHARED_RUN_FILES = {
    "library/test_torchtitan_checkpointer.py",
    # torchtitan's and Megatron's own model code writes each chain's checkpoint (torchrun, 2 or 4 ranks): split
    # over both workers, three of its four writers ran twice
    "trainer/test_dcp_frameworks.py",
    "trainer/test_dcp_import.py",
    "trainer/test_megatron_export.py",  # Megatron writes, then loads three exports: ~35 s, once
    "trainer/test_megatron_optimizer_export.py",  # Megatron trains, saves and loads four optimizers: ~60 s, once
    "trainer/test_torchtitan_gpt_oss.py",  # torchtitan's gpt-oss writes its checkpoint once
}

# A file moved or renamed would silently leave its group (its drills side by side, its run made twice): say so.
_missing = sorted(p for p in SERIAL_FILES | SHARED_RUN_FILES if not (TESTS / p).is_file())
if _missing:
    raise RuntimeError(f"tests/conftest.py groups files that are not there: {', '.join(_missing)}")


def _in_tests(path: Path) -> str:
    """``path`` relative to the tests folder (``e2e/test_demo.py``); its full path if outside it."""
    return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else path.as_posix()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marker into the group (else ignored)
def pytest_collection_modifyitems(config, items):
    for item in items:
        where = _in_tests(item.path.resolve())
        if where in SERIAL_FILES:
            item.add_marker(pytest.mark.xdist_group("drills"))
        elif where in SHARED_RUN_FILES:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    # xdist hands out the groups first (the largest first), then single tests in this order: the files with slow
    # tests (a drill is tens of seconds) go before the rest, so that the quick tests fill the end of the run and
    # neither worker waits alone on a drill at the end. Each file stays in one piece: its module fixtures are made
    # once per worker, as before.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


#: storages of the shared suite; S3 is added by the S3 fixture module when moto is installed.
STORAGES = ["local", "memory", "s3"]
#: every registered format: the built-ins and the tests' own "raw".
BACKENDS = list(backend_names())


@pytest.fixture(params=STORAGES)
def storage_url(request, tmp_path) -> str:
    """A fresh, empty location for one checkpoint on each kind of storage."""
    kind = request.param
    if kind == "local":
        return str(tmp_path / "ckpt")
    if kind == "memory":
        return f"memory://moeckpt-tests/{os.getpid()}-{next(_counter)}/ckpt"
    return request.getfixturevalue(f"{kind}_url")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def moeckpt_cli(capsys, monkeypatch):
    """Run ``moeckpt ARGS`` in-process exactly as the console script does; returns (exit code, stdout, stderr)."""
    from moeckpt.cli.main import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["moeckpt", *map(str, args)])
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """``moeckpt demo`` run once for the whole suite (its elastic drill is the suite's longest job): the exit code,
    output, and its directory (``run/`` the drill's run directory, ``drill.json`` what the drill saw)."""
    import subprocess

    root = tmp_path_factory.mktemp("demo")
    proc = subprocess.run(
        [sys.executable, "-m", "moeckpt.cli.main", "demo", "--dir", str(root)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return proc.returncode, proc.stdout, proc.stderr, root
