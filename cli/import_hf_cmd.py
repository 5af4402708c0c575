"""``moeckpt import-hf``: a Hugging Face model directory as a training checkpoint in any layout."""

from __future__ import annotations

import click

from moeckpt.formats import dtypes
from moeckpt.reshard.layout import Layout
from moeckpt.trainer.hf_import import HfImport

from .common import (
    announce_overwrite,
    compress_option,
    format_option,
    layout_options,
    progress,
    workers_option,
)
from .params import Text

DTYPES = dtypes.short_names("bf16", "fp32")


@click.command("import-hf")
@click.argument("hf_dir", type=Text())
@click.argument("dst", type=Text())
@layout_options
@format_option
@compress_option
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPES)),
    default="fp32",
    show_default=True,
    help="parameter dtype of the checkpoint (bf16 also keeps fp32 master weights)",
)
@click.option("--overwrite", is_flag=True, help="replace whatever DST holds; it says what it removes first")
@workers_option
def command(hf_dir, dst, tp, ep, dp, fmt, compress, dtype, overwrite, workers) -> None:
    """Write the model in HF_DIR (local path or URL; per-expert or fused expert tensors) to DST in layout
    (tp, ep, dp), with fresh optimizer state, ready for `moeckpt train` to fine-tune."""
    layout = Layout(tp=tp, ep=ep, dp=dp)
    job = HfImport(hf_dir, layout=layout, backend=fmt, dtype=DTYPES[dtype], compress=compress)
    said = announce_overwrite(dst, overwrite)
    with progress(job.index.nbytes, "import-hf") as bar:
        index = job.write(dst, overwrite=overwrite, workers=workers, on_bytes=bar.update)
    arch = index.model["arch"]
    said()
    click.echo(f"wrote {dst}: {arch}, {layout}, {len(index.tensors)} tensors, {index.nbytes / 1e6:.2f} MB ({fmt})")
