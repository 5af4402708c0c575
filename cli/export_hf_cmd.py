"""``moeckpt export-hf``: a checkpoint, from any layout and storage, as a Hugging Face model directory."""

from __future__ import annotations

import click

from moeckpt.formats import dtypes
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import ChecksumMismatchError, DataFileError
from moeckpt.trainer.hf_export import export_hf, parse_size
from moeckpt.trainer.models import UnknownModelError, resolve_model

from .common import announce_overwrite, progress
from .params import Text

DTYPES = dtypes.short_names("bf16", "fp32")


@click.command("export-hf")
@click.argument("ckpt", type=Text())
@click.argument("out", type=Text())
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPES)),
    default=None,
    help="dtype of the exported weights [default: the checkpoint's parameter dtype]",
)
@click.option("--max-shard-size", default="5GB", show_default=True, help="largest safetensors shard (5GB, 500MB, 2GiB)")
@click.option(
    "--overwrite", is_flag=True, help="replace a previous export in OUT (other files in OUT, a tokenizer say, are kept)"
)
@click.option(
    "--model",
    "model_name",
    type=Text(),
    default=None,
    metavar="PRESET|JSON",
    help="for a state-dict checkpoint (moeckpt.save, moeckpt.dcp): the bundled model its tensors are, under "
    "their Hugging Face names  [default: the model the checkpoint records]",
)
def command(ckpt, out, dtype, max_shard_size, overwrite, model_name) -> None:
    """Write CKPT's weights to OUT as sharded safetensors with config.json, loadable by transformers'
    AutoModelForCausalLM.from_pretrained. CKPT may be a run directory (its newest committed step).

    The export is staged and committed like a checkpoint: until it is complete nothing at OUT is an export, and an
    interrupted or failed one leaves nothing behind."""
    size = parse_size(max_shard_size)
    try:
        model = resolve_model(model_name) if model_name is not None else None
    except UnknownModelError as e:
        raise click.BadParameter(str(e), param_hint="'--model'") from None
    params = [t for t in CheckpointReader(ckpt).index.tensors.values() if t.role == "param"]
    total = sum(t.nbytes // dtypes.itemsize(t.dtype) * dtypes.itemsize(DTYPES.get(dtype) or t.dtype) for t in params)
    said = announce_overwrite(out, overwrite)
    try:
        with progress(total, "export-hf") as bar:
            result = export_hf(
                ckpt,
                out,
                dtype=DTYPES.get(dtype),
                max_shard_size=size,
                overwrite=overwrite,
                on_bytes=bar.update,
                model=model,
            )
    except ChecksumMismatchError as e:  # the source is damaged: bad input for an export (verify reports it as 1)
        raise DataFileError(str(e)) from None
    said()
    click.echo(
        f"wrote {out}: {result.num_tensors} tensors, {len(result.files)} shard(s), "
        f"{result.total_size / 1e6:.2f} MB ({result.dtype})"
    )
