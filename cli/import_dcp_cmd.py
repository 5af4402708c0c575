"""``moeckpt import-dcp``: a torch DCP checkpoint (torchtitan, Megatron-Core torch_dist, any dcp.save) as a moeckpt
checkpoint in any layout, read without running its pickles."""

from __future__ import annotations

import click

from moeckpt.reshard.layout import Layout
from moeckpt.trainer.interop import MAPPINGS, DcpImport
from moeckpt.trainer.models import UnknownModelError, resolve_model

from .common import announce_overwrite, compress_option, format_option, layout_options, progress, workers_option
from .params import Text


@click.command("import-dcp")
@click.argument("dcp_dir", type=Text())
@click.argument("dst", type=Text())
@layout_options(default_source=True)
@format_option
@compress_option
@click.option(
    "--model",
    "model_name",
    type=Text(),
    default=None,
    metavar="PRESET|JSON",
    help="PRESET or config.json (ours or a Hugging Face one): the fields tensor shapes do not tell "
    "(top-k, RoPE theta, ...) for a named mapping  [default: taken from the shapes, Qwen3-MoE defaults]",
)
@click.option(
    "--mapping",
    type=click.Choice(MAPPINGS),
    default="none",
    show_default=True,
    help="none: keep the names (a generic checkpoint); torchtitan: map onto the plan of its family (qwen3_moe, "
    "or deepseek_v3 with --model its config.json); megatron: onto qwen3_moe, or with --model mixtral (no q/k "
    "norms) or deepseek_v3 (latent attention)",
)
@click.option("--overwrite", is_flag=True, help="replace whatever DST holds; it says what it removes first")
@workers_option
def command(dcp_dir, dst, tp, ep, dp, fmt, compress, model_name, mapping, overwrite, workers) -> None:
    """Convert the DCP checkpoint in DCP_DIR (local path or URL: .metadata and __R_N.distcp files, any sharding)
    into a moeckpt checkpoint at DST in layout (tp, ep, dp), streaming each chunk once with bounded memory.
    With --mapping none and no layout given, the names and the DCP shardings are kept as they are (each chunk a
    piece, in the file of the rank that wrote it; moeckpt.load reads it into any mesh); --dp N splits every tensor
    along dim 0 over N files instead.

    Nothing is unpickled by pickle itself: .metadata is read by a restricted unpickler that admits only DCP's own
    metadata classes, tensor data is located inside each torch.save record and read as raw bytes, and non-tensor
    values go through torch.load(weights_only=True). Optimizer state (AdamW moments) comes along when the mapping
    knows it; what is dropped is printed.
    """
    given = any(d is not None for d in (tp, ep, dp))
    layout = Layout(tp=tp or 1, ep=ep or 1, dp=dp or 1) if given or mapping != "none" else None
    try:
        model = resolve_model(model_name) if model_name is not None else None
    except UnknownModelError as e:
        raise click.BadParameter(str(e), param_hint="'--model'") from None
    job = DcpImport(dcp_dir, layout=layout, mapping=mapping, backend=fmt, model=model, compress=compress)
    for note in job.notes:
        click.echo(f"note: {note}", err=True)
    said = announce_overwrite(dst, overwrite)
    with progress(job.index.nbytes, "import-dcp") as bar:
        index, read = job.write(dst, overwrite=overwrite, workers=workers, on_bytes=bar.update)
    said()
    roles = sorted({t.role for t in index.tensors.values()})
    click.echo(
        f"wrote {dst}: {index.model['arch']}, {'DCP shardings kept' if job.targets is not None else job.layout}, "
        f"{len(index.tensors)} tensors ({', '.join(roles)}), "
        f"{index.nbytes / 1e6:.2f} MB ({fmt}); read {read / 1e6:.2f} MB of DCP data"
    )
