"""``moeckpt verify``: check every checksum and the exact cover of every tensor."""

from __future__ import annotations

import sys

import click

from moeckpt.formats.checkpoint import CheckpointReader, verify

from .common import progress


@click.command("verify")
@click.argument("ckpt")
def command(ckpt: str) -> None:
    """Read every piece of CKPT and check it; exit 1 naming each damaged file and tensor."""
    reader = CheckpointReader(ckpt)
    stored = sum(f.size for f in reader.index.files.values())
    with progress(stored, "verify") as bar:
        problems = verify(reader, on_piece=lambda ref: bar.update(ref.nbytes))
    if problems:
        for p in problems:
            click.echo(f"FAIL {p}", err=True)
        click.echo(f"moeckpt: verify failed: {len(problems)} problem(s) in {reader.location}", err=True)
        sys.exit(1)
    click.echo(f"OK {reader.location}: {len(reader.index.tensors)} tensors, {len(reader.index.files)} files verified")
