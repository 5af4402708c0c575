"""The repository's promises to a fresh user: README's commands are what CI runs."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```bash\n(python3 -m venv[^\n]+)\n```", text)


def test_readme_has_exactly_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("moeckpt demo")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert _readme_commands()[1] in ci
