"""``moeckpt diff``: layout-independent comparison of two checkpoints."""

from __future__ import annotations

import sys
from contextlib import closing

import click
import torch

from moeckpt.formats import dtypes
from moeckpt.formats.checkpoint import CheckpointReader, ReusedBuffer

from .params import Text


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


@click.command("diff")
@click.argument("ckpt_a", type=Text())
@click.argument("ckpt_b", type=Text())
def command(ckpt_a: str, ckpt_b: str) -> None:
    """Compare every logical tensor of CKPT_A and CKPT_B, whatever their layouts and formats.

    Exit 0 iff both hold the same tensors with identical values (bit for bit), else list those that differ.
    """
    a, b = CheckpointReader(ckpt_a), CheckpointReader(ckpt_b)
    names_a, names_b = set(a.index.tensors), set(b.index.tensors)
    differences: list[str] = []
    for n in sorted(names_a - names_b):
        differences.append(f"only in A: {n}")
    for n in sorted(names_b - names_a):
        differences.append(f"only in B: {n}")
    pieces_a, pieces_b = _by_tensor(a.pieces()), _by_tensor(b.pieces())
    # Each side through one read session (mapped where the storage maps, verified over the page cache) into one
    # reused buffer: a fresh buffer per read and per tensor had every byte compared land in newly faulted pages.
    buf_a, buf_b = ReusedBuffer(), ReusedBuffer()
    with closing(a.open_reader()) as session_a, closing(b.open_reader()) as session_b:
        for name in sorted(names_a & names_b):
            ea, eb = a.index.tensors[name], b.index.tensors[name]
            if ea.shape != eb.shape or ea.dtype != eb.dtype:
                differences.append(f"{name}: {list(ea.shape)} {ea.dtype} vs {list(eb.shape)} {eb.dtype}")
                continue
            dtype = dtypes.to_torch(ea.dtype)
            ta = a.read_box(name, _full(ea), pieces_a.get(name, []), out=buf_a.get(ea.shape, dtype), session=session_a)
            tb = b.read_box(name, _full(eb), pieces_b.get(name, []), out=buf_b.get(eb.shape, dtype), session=session_b)
            if not torch.equal(_bytes(ta), _bytes(tb)):
                differences.append(f"{name}: max abs diff {max_abs_diff(ta, tb):.6g}")
    if differences:
        for d in differences:
            click.echo(d)
        click.echo(f"{len(differences)} tensor(s) differ", err=True)
        sys.exit(1)
    click.echo(f"identical: {len(names_a)} tensors (A {a.index.layout}, B {b.index.layout})")


def _by_tensor(refs) -> dict[str, list]:
    out: dict[str, list] = {}
    for ref in refs:
        out.setdefault(ref.tensor, []).append(ref)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as a flat uint8 tensor (so NaNs compare bit for bit); takes 0-d and empty tensors."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _full(entry):
    from moeckpt.formats.box import Box

    return Box.full(entry.shape)
