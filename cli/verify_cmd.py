"""``moeckpt verify``: check the index, every checksum and the exact cover of every tensor.

Exit codes: 0 the checkpoint is sound; 1 a checkpoint exists at CKPT but fails a check (its index is unreadable
or inconsistent, a data file is missing, truncated or corrupt, a tensor is not covered exactly once); 2 there
is no checkpoint at CKPT (or only an unfinished save), or it was written by a newer format version than this
moeckpt can check.
"""

from __future__ import annotations

import sys

import click

from moeckpt.formats.checkpoint import CheckpointReader, verify
from moeckpt.formats.errors import CheckpointIndexError, DataFileError, UnsafePathError

from .common import progress
from .params import Text


@click.command("verify")
@click.argument("ckpt", type=Text())
def command(ckpt: str) -> None:
    """Read every piece of CKPT and check it; exit 1 naming each damaged file and tensor (a corrupt index
    included), 2 when there is no checkpoint at CKPT."""
    try:
        reader = CheckpointReader(ckpt)
    except (CheckpointIndexError, UnsafePathError, DataFileError) as e:
        _failed([str(e)], ckpt)
    stored = sum(f.size for f in reader.index.files.values())
    with progress(stored, "verify") as bar:
        problems = verify(reader, on_piece=lambda ref: bar.update(ref.nbytes))
    if problems:
        _failed(problems, reader.location)
    click.echo(f"OK {reader.location}: {len(reader.index.tensors)} tensors, {len(reader.index.files)} files verified")


def _failed(problems: list[str], where: str) -> None:
    for p in problems:
        click.echo(f"FAIL {p}", err=True)
    click.echo(f"moeckpt: verify failed: {len(problems)} problem(s) in {where}", err=True)
    sys.exit(1)
