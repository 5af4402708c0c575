"""``moeckpt reshard``: rewrite a checkpoint in another (tp, ep, dp) layout, format or storage, streaming."""

from __future__ import annotations

import click

from moeckpt.formats.backend import get_backend
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import LayoutError
from moeckpt.reshard.executor import reshard
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.options import OFFLINE_WORKERS, ReshardOptions, offline_workers
from moeckpt.reshard.state_dict_checkpoints import WriterMesh, is_state_dict
from moeckpt.reshard.tensors import check_layout
from moeckpt.trainer.models import ModelSpec

from .common import FormatChoice, announce_overwrite, compress_option, layout_options, progress
from .params import Text, count


@click.command("reshard")
@click.argument("src", type=Text())
@click.argument("dst", type=Text())
@layout_options(default_source=True)
@click.option(
    "--format",
    "fmt",
    type=FormatChoice(),
    default=None,
    help="on-disk format of the checkpoint written  [default: the source's]",
)
@compress_option(default_source=True)
@click.option(
    "--workers",
    type=count(1, 256),
    default=offline_workers,
    show_default=f"{OFFLINE_WORKERS}, or the machine's cores if fewer",
    help="target files written in parallel (by processes from local safetensors to local safetensors, else threads)",
)
@click.option(
    "--mesh",
    metavar="SHAPE",
    default=None,
    callback=lambda ctx, param, value: _checked_shape(value),
    help="for a state-dict checkpoint (moeckpt.save): the target as a mesh of writers, e.g. 4 or 2x2 (instead of "
    "--tp/--ep/--dp)",
)
@click.option(
    "--placements",
    metavar="P,...",
    default=None,
    help="with --mesh: every tensor's placement on each mesh dimension, R or S(dim), e.g. 'S(0),S(1)'; S(dim) of "
    "a tensor without that dim is R  [default: S(0) on every mesh dimension]",
)
@click.option("--overwrite", is_flag=True, help="replace whatever DST holds; it says what it removes first")
def command(src, dst, tp, ep, dp, fmt, compress, workers, mesh, placements, overwrite) -> None:
    """Write checkpoint SRC (or a run directory's newest step) to DST in layout (tp, ep, dp); a degree not given
    keeps the source's, so `--format zarr` alone converts the format at the same layout. A state-dict checkpoint
    (moeckpt.save of any model) has no model plan: give --dp N (N writers, every tensor split along dim 0) or
    --mesh SHAPE [--placements P,...].

    Pieces stream through a bounded memory: a few slabs per worker, never the checkpoint. The new checkpoint
    keeps the step, train state and model, with new files and checksums.
    """
    index = CheckpointReader(src).index
    writer_mesh = _writer_mesh(mesh, placements, tp, ep, dp, is_state_dict(index))
    if writer_mesh is not None:
        tp, ep, dp = 1, 1, writer_mesh.writers
    source = Layout.from_json(index.layout)
    tp, ep, dp = (source.tp if tp is None else tp), (source.ep if ep is None else ep), (source.dp if dp is None else dp)
    layout = Layout(tp=tp, ep=ep, dp=dp)
    # The model's own constraints (heads, vocabulary) first, then the stored rules of every tensor.
    if not is_state_dict(index):  # a state dict (moeckpt.save, import-dcp --mapping none) has no model
        ModelSpec.from_json(index.model).check_layout(tp, ep)
    check_layout(index.tensors, layout)
    if compress is not None:
        get_backend(fmt or index.backend, compress=compress)  # refused before anything is written
    said = announce_overwrite(dst, overwrite)
    with progress(index.nbytes, f"reshard -> {layout}") as bar:
        result = reshard(
            src,
            dst,
            layout,
            backend=fmt,
            compress=compress,
            overwrite=overwrite,
            on_bytes=bar.update,
            options=ReshardOptions(workers=workers),
            mesh=writer_mesh,
        )
    gb = result.bytes_written / 1e9
    said()
    target = f"mesh {writer_mesh.text} [{','.join(writer_mesh.placements)}]" if writer_mesh is not None else layout
    click.echo(
        f"wrote {dst}: {target}, {len(result.index.files)} files, {gb:.3f} GB ({result.index.backend}) in "
        f"{result.seconds:.2f} s ({gb / max(result.seconds, 1e-9):.2f} GB/s), read {result.bytes_read / 1e9:.3f} GB"
    )


def _writer_mesh(mesh, placements, tp, ep, dp, state_dict: bool) -> WriterMesh | None:
    """The ``--mesh`` / ``--placements`` target, refusing them with a model checkpoint or beside a layout."""
    if mesh is None:
        if placements is not None:
            raise click.UsageError("--placements needs --mesh (the mesh they place tensors on)")
        return None
    if not state_dict:
        raise click.UsageError(
            "--mesh is for state-dict checkpoints (moeckpt.save, moeckpt.dcp); this checkpoint records its model's "
            "plan: give --tp/--ep/--dp"
        )
    if tp is not None or ep is not None or dp is not None:
        raise click.UsageError("--mesh gives the whole target; leave out --tp, --ep and --dp")
    try:
        return WriterMesh.parse(mesh, placements)
    except LayoutError as e:
        raise click.BadParameter(str(e), param_hint="'--placements'") from None


def _checked_shape(value: str | None) -> str | None:
    if value is not None:
        try:
            WriterMesh.parse_shape(value)
        except LayoutError as e:
            raise click.BadParameter(str(e), param_hint="'--mesh'") from None
    return value
