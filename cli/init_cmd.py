"""``moeckpt init``: write a randomly initialised, complete checkpoint of a model in a layout."""

from __future__ import annotations

import click

from moeckpt.reshard.layout import Layout
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.trainer.init_values import initial_value
from moeckpt.trainer.models import resolve_model

from .common import format_option, layout_options, sigterm_unwinds

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@click.command("init")
@click.argument("out")
@click.option("--model", "model_name", required=True, help="preset name (e.g. zaya-tiny) or a config.json")
@layout_options
@format_option
@click.option("--with-optimizer", is_flag=True, help="also write AdamW state (and fp32 master weights for bf16)")
@click.option("--seed", type=int, default=0, show_default=True, help="values depend only on (seed, tensor name)")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="fp32", show_default=True, help="parameter dtype")
@click.option("--overwrite", is_flag=True, help="replace whatever OUT holds")
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True, help="parallel file writers")
def command(out, model_name, tp, ep, dp, fmt, with_optimizer, seed, dtype, overwrite, workers) -> None:
    """Write a random checkpoint of MODEL to OUT in layout (tp, ep, dp).

    The same seed gives the same logical checkpoint in every layout, so `moeckpt diff` of two inits that differ
    only in layout exits 0.
    """
    spec = resolve_model(model_name)
    spec.check_layout(tp, ep)
    layout = Layout(tp=tp, ep=ep, dp=dp)
    params = spec.param_specs()
    init_of = {p.name: p.init for p in params}
    tensors = logical_tensors(params, param_dtype=DTYPES[dtype], with_optimizer=with_optimizer)
    std = getattr(spec.config, "initializer_range", 0.02)
    with sigterm_unwinds():
        index = save_full_tensors(
            out,
            tensors=tensors,
            layout=layout,
            values=lambda e: initial_value(e, seed=seed, init=init_of[e.param], std=std),
            model=spec.to_json(),
            backend=fmt,
            train_state={"step": 0, "seed": seed},
            overwrite=overwrite,
            workers=workers,
        )
    click.echo(
        f"wrote {out}: {spec.arch} ({model_name}), {layout}, {len(index.tensors)} tensors, "
        f"{len(index.files)} files, {index.nbytes / 1e6:.2f} MB ({fmt})"
    )
