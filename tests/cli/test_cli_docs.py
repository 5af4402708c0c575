"""docs/cli.md documents every option of every command (generated or written by hand) in that command's section,
and every command has a section: the reference cannot fall behind the code."""

from __future__ import annotations

import os
import re

import click

from moeckpt.cli.main import all_commands, cli

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "cli.md")


def _sections() -> dict[str, str]:
    text = open(DOC, encoding="utf-8").read()
    out = {}
    for block in re.split(r"\n(?=## )", text):
        m = re.match(r"## moeckpt ([a-z-]+)", block)
        if m:
            out[m.group(1)] = block
    out[""] = text.split("## Options of every command", 1)[1].split("\n## ", 1)[0]
    return out


def _spellings(cmd: click.Command) -> list[str]:
    return [s for p in cmd.params if isinstance(p, click.Option) for s in (*p.opts, *p.secondary_opts)]


def test_every_option_of_every_command_is_in_its_section_of_docs_cli_md():
    sections = _sections()
    missing = []
    for name, cmd in all_commands().items():
        assert name in sections, f"docs/cli.md has no '## moeckpt {name}' section"
        body = sections[name]
        for spelling in _spellings(cmd):
            if spelling in ("-h", "--help"):
                continue
            if not re.search(rf"(?<![\w-]){re.escape(spelling)}(?![\w-])", body):
                missing.append(f"{name} {spelling}")
        for p in cmd.params:
            if isinstance(p, click.Argument):
                assert p.human_readable_name in body.splitlines()[0], (name, p.human_readable_name)
    for spelling in _spellings(cli):
        if spelling not in ("-h", "--help") and spelling not in sections[""]:
            missing.append(f"(group) {spelling}")
    assert not missing, f"options missing from docs/cli.md: {missing}"


def test_the_documented_defaults_of_train_match_the_config():
    """The train section's tables say the default of each option that has one as '(default X)'."""
    from dataclasses import MISSING, fields

    from moeckpt.trainer.config import TrainConfig

    body = _sections()["train"]
    for f in fields(TrainConfig):
        if f.default in (MISSING, None, "", False) or isinstance(f.default, bool):
            continue
        row = next(line for line in body.splitlines() if line.startswith(f"| `{TrainConfig.option_name(f)}"))
        shown = {"fp32": "fp32", "safetensors": "safetensors", "auto": "auto", "moeckpt": "`moeckpt`"}.get(
            f.default, f"{f.default:g}" if isinstance(f.default, float) else str(f.default)
        )
        assert f"default {shown}" in row or f"default: {shown}" in row or f"default {shown})" in row, (f.name, row)
