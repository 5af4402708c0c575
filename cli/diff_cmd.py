"""``moeckpt diff``: layout-independent comparison of two checkpoints."""

from __future__ import annotations

import sys

import click
import torch

from moeckpt.formats.checkpoint import CheckpointReader

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
    pieces_a, pieces_b = a.pieces(), b.pieces()
    for name in sorted(names_a & names_b):
        ea, eb = a.index.tensors[name], b.index.tensors[name]
        if ea.shape != eb.shape or ea.dtype != eb.dtype:
            differences.append(f"{name}: {list(ea.shape)} {ea.dtype} vs {list(eb.shape)} {eb.dtype}")
            continue
        ta = a.read_box(name, _full(ea), [p for p in pieces_a if p.tensor == name])
        tb = b.read_box(name, _full(eb), [p for p in pieces_b if p.tensor == name])
        if not torch.equal(_bytes(ta), _bytes(tb)):
            differences.append(f"{name}: max abs diff {max_abs_diff(ta, tb):.6g}")
    if differences:
        for d in differences:
            click.echo(d)
        click.echo(f"{len(differences)} tensor(s) differ", err=True)
        sys.exit(1)
    click.echo(f"identical: {len(names_a)} tensors (A {a.index.layout}, B {b.index.layout})")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as a flat uint8 tensor (so NaNs compare bit for bit); takes 0-d and empty tensors."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _full(entry):
    from moeckpt.formats.box import Box

    return Box.full(entry.shape)
