"""``moeckpt export-dcp``: a moeckpt checkpoint as a standard torch DCP checkpoint (torch's own dcp.save)."""

from __future__ import annotations

import click

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.trainer.interop.dcp_export import (
    EXPORT_MAPPINGS,
    default_mapping,
    export_dcp,
)
from moeckpt.trainer.interop.megatron_optimizer import MegatronOptimizerConfig

from .common import announce_overwrite, progress
from .config_options import config_from_options, config_options
from .params import Text


@click.command("export-dcp")
@click.argument("ckpt", type=Text())
@click.argument("out", type=Text())
@click.option(
    "--mapping",
    type=click.Choice(EXPORT_MAPPINGS),
    default=None,
    help="torchtitan: torchtitan's names (Qwen3-MoE or DeepSeek-V3) and flattened optimizer; megatron: "
    "Megatron-Core's dist_checkpointing checkpoint of its GPTModel (Qwen3-MoE, Mixtral or DeepSeek-V3; "
    "with --megatron-optimizer, AdamW's state for its optimizer); none: our tensor names  [default: torchtitan "
    "for a qwen3_moe or deepseek_v3 checkpoint, else none]",
)
@click.option("--overwrite", is_flag=True, help="replace whatever OUT holds; it says what it removes first")
@config_options(MegatronOptimizerConfig)
def command(ckpt, out, mapping, overwrite, **megatron) -> None:
    """Write CKPT (any layout and storage; a run directory: its newest step) to OUT, a local directory, as a DCP
    checkpoint that dcp.load reads, e.g. into a torchtitan model and its optimizer, or that Megatron-Core's
    dist_checkpointing.load reads into its GPTModel (and its optimizer). One tensor in memory at a time."""
    config = config_from_options(MegatronOptimizerConfig, megatron)
    reader = CheckpointReader(ckpt)
    mapping = mapping or default_mapping(reader)
    said = announce_overwrite(out, overwrite)
    with progress(reader.index.nbytes, "export-dcp") as bar:
        result = export_dcp(ckpt, out, mapping=mapping, overwrite=overwrite, on_bytes=bar.update, megatron=config)
    said()
    for note in result["notes"]:
        click.echo(f"note: {note}", err=True)
    click.echo(f"wrote {out}: {result['tensors']} tensors, {result['bytes'] / 1e6:.2f} MB (DCP, mapping {mapping})")
