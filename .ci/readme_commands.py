"""The two set-up commands of README.md, read out of it for CI to run verbatim.

A set-up command is a line of a fenced code block that makes a virtual environment (``python3 -m venv``).
README.md must hold exactly two: the main job (it ends by running ``moeckpt demo``) and the tests (it ends by
running pytest). ``python3 .ci/readme_commands.py main`` (or ``test``) prints one; ``--check`` only checks.
tests/e2e/test_install.py holds README.md to the same rule.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)


class ReadmeError(ValueError):
    """README.md does not hold the two set-up commands CI runs."""


def setup_commands(text: str) -> list[str]:
    """Every line of a fenced block in ``text`` that makes a virtual environment, in order."""
    lines = [ln.strip() for block in FENCE.findall(text) for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith("python3 -m venv")]


def readme_commands(text: str) -> dict[str, str]:
    """``{"main": ..., "test": ...}`` from README.md's text; ReadmeError unless there are exactly those two."""
    found = setup_commands(text)
    if len(found) != 2:
        raise ReadmeError(f"README.md has {len(found)} set-up commands (lines that make a venv), not 2: {found}")
    main, test = found
    if not main.endswith("moeckpt demo"):
        raise ReadmeError(f"README.md's first set-up command does not end by running `moeckpt demo`: {main}")
    if "pytest" not in test.rsplit("&&", 1)[-1]:
        raise ReadmeError(f"README.md's second set-up command does not end by running pytest: {test}")
    return {"main": main, "test": test}


def main(argv: list[str]) -> int:
    try:
        commands = readme_commands(README.read_text())
    except ReadmeError as e:
        print(f"readme_commands: {e}", file=sys.stderr)
        return 1
    if argv == ["--check"]:
        return 0
    if len(argv) != 1 or argv[0] not in commands:
        print("usage: readme_commands.py main|test|--check", file=sys.stderr)
        return 2
    print(commands[argv[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
