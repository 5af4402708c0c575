"""``moeckpt init``: write a randomly initialised, complete checkpoint of a model in a layout."""

from __future__ import annotations

import os
import shutil

import click

from moeckpt.formats import dtypes
from moeckpt.formats.backend import get_backend
from moeckpt.formats.roles import PARAM
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.trainer.init_values import initial_value
from moeckpt.trainer.memory import check_fits
from moeckpt.trainer.models import UnknownModelError, presets, resolve_model

from .common import (
    announce_overwrite,
    compress_option,
    format_option,
    layout_options,
    progress,
    workers_option,
)
from .params import Text, count

DTYPES = dtypes.short_names("fp32", "bf16", "fp16")


def _presets_help() -> str:
    lines = []
    for name, spec in presets().items():
        params = sum(_numel(p.shape) for p in spec.param_specs())
        lines.append(f"{name} ({spec.arch}, {params / 1e6:,.1f}M parameters)")
    return "; ".join(lines)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@click.command("init", epilog=f"Presets: {_presets_help()}.")
@click.argument("out", type=Text())
@click.option(
    "--model",
    "model_name",
    required=True,
    type=Text(),
    metavar="PRESET|JSON",
    help=f'a preset ({", ".join(presets())}), a {{"arch", "config"}} JSON file or a Hugging Face config.json',
)
@layout_options
@format_option
@compress_option
@click.option("--with-optimizer", is_flag=True, help="also write AdamW state (and fp32 master weights for bf16)")
@click.option(
    "--seed", type=count(0, 2**63 - 1), default=0, show_default=True, help="values depend only on (seed, tensor name)"
)
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="fp32", show_default=True, help="parameter dtype")
@click.option(
    "--overwrite",
    is_flag=True,
    help="replace whatever OUT holds (a checkpoint, a run directory, any files); it says what it removes first",
)
@workers_option
def command(out, model_name, tp, ep, dp, fmt, compress, with_optimizer, seed, dtype, overwrite, workers) -> None:
    """Write a random checkpoint of MODEL to OUT in layout (tp, ep, dp).

    The same seed gives the same logical checkpoint in every layout, so `moeckpt diff` of two inits that differ
    only in layout exits 0.
    """
    try:
        spec = resolve_model(model_name)
    except UnknownModelError as e:
        raise click.BadParameter(str(e), param_hint="'--model'") from None
    spec.check_layout(tp, ep)
    layout = Layout(tp=tp, ep=ep, dp=dp)
    get_backend(fmt, compress=compress)  # a format that cannot compress is refused before any work
    params = spec.param_specs()
    init_of = {p.name: p.init for p in params}
    tensors = logical_tensors(params, param_dtype=DTYPES[dtype], with_optimizer=with_optimizer)
    # parameters no optimizer steps (DeepSeek-V3's correction biases) have no optimizer state, as a trainer saves them
    held = spec.untrained()
    tensors = {n: e for n, e in tensors.items() if e.role == PARAM or e.param not in held}
    total = sum(e.nbytes for e in tensors.values())
    # Every value is made in memory before the files are written: refuse what cannot fit before making any.
    check_fits(
        total,
        ranks_here=1,
        device_type="cpu",
        what=f"init of {model_name} ({total / 1e9:,.2f} GB)",
        fix="pick a smaller model (or --dtype bf16)",
    )
    _check_disk(out, total)
    said = announce_overwrite(out, overwrite)
    std = getattr(spec.config, "initializer_range", 0.02)
    with progress(total, "init values") as made, progress(total, "init write") as written:

        def value(e):
            v = initial_value(e, seed=seed, init=init_of[e.param], std=std)
            made.update(e.nbytes)
            return v

        index = save_full_tensors(
            out,
            tensors=tensors,
            layout=layout,
            values=value,
            model=spec.to_json(),
            backend=fmt,
            compress=compress,
            train_state={"step": 0, "seed": seed},
            overwrite=overwrite,
            workers=workers,
            on_written=written.update,
        )
    said()
    click.echo(
        f"wrote {out}: {spec.arch} ({model_name}), {layout}, {len(index.tensors)} tensors, "
        f"{len(index.files)} files, {index.nbytes / 1e6:.2f} MB ({fmt})"
    )


def _check_disk(out: str, nbytes: int) -> None:
    """A local OUT must have room for the checkpoint (object stores have no such limit to ask about)."""
    storage = open_storage(out)
    if not storage.is_local:
        return
    parent = os.path.abspath(storage.location)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    free = shutil.disk_usage(parent).free
    if nbytes > free:
        raise click.UsageError(
            f"OUT {out}: the checkpoint needs {nbytes / 1e9:,.2f} GB, the disk has {free / 1e9:,.2f} GB free"
        )
