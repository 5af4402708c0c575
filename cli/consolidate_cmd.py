"""``moeckpt consolidate``: any checkpoint's tensors, whole and under their own names, as sharded safetensors."""

from __future__ import annotations

import click

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import ChecksumMismatchError, DataFileError
from moeckpt.formats.hf_shards import parse_size
from moeckpt.library.consolidate import consolidate

from .common import announce_overwrite, progress
from .params import Text


@click.command("consolidate")
@click.argument("ckpt", type=Text())
@click.argument("out", type=Text())
@click.option("--max-shard-size", default="5GB", show_default=True, help="largest safetensors shard (5GB, 500MB, 2GiB)")
@click.option("--overwrite", is_flag=True, help="replace a previous consolidation in OUT (other files in OUT are kept)")
def command(ckpt, out, max_shard_size, overwrite) -> None:
    """Write every tensor of CKPT whole, under its own name and dtype, to OUT as Hugging Face sharded safetensors
    (model-0000k-of-0000n.safetensors and model.safetensors.index.json), as DCP's consolidation does. No model
    plan is needed: a moeckpt.save of any model, on any mesh, consolidates. CKPT may be a run directory (its
    newest committed step).

    Tensors stream in runs of rows (about 64 MiB), every byte verified against the checkpoint's checksums; the
    output is staged and committed, so an interrupted or failed run leaves nothing at OUT."""
    size = parse_size(max_shard_size)
    total = CheckpointReader(ckpt).index.nbytes
    said = announce_overwrite(out, overwrite)
    try:
        with progress(total, "consolidate") as bar:
            result = consolidate(ckpt, out, max_shard_size=size, overwrite=overwrite, on_bytes=bar.update)
    except ChecksumMismatchError as e:  # the source is damaged: bad input here (verify reports it as 1)
        raise DataFileError(str(e)) from None
    said()
    gb = result.total_size / 1e9
    click.echo(
        f"wrote {out}: {result.num_tensors} tensors, {len(result.files)} shard(s), {gb:.3f} GB in "
        f"{result.seconds:.2f} s ({gb / max(result.seconds, 1e-9):.2f} GB/s)"
    )
