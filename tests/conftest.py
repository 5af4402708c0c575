"""Shared fixtures: the storages every format test runs over (local directory, memory://, and S3 via moto)."""

from __future__ import annotations

import itertools
import os
import sys

import pytest

from moeckpt.formats.backend import backend_names

from . import raw_backend  # noqa: F401  (registers the tests' third format, "raw")
from .s3_fixtures import moto_endpoint, s3_url  # noqa: F401  (fixtures: S3 via moto's server mode)

_counter = itertools.count()

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
