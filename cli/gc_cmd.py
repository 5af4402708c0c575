"""``moeckpt gc``: apply a retention policy to a run directory and remove leftovers of failed saves."""

from __future__ import annotations

import os
import shutil

import click

from moeckpt.formats.checkpoint import STAGING_SUFFIX, STEP_PREFIX
from moeckpt.formats.errors import NotCommittedError
from moeckpt.formats.index import INDEX_NAME
from moeckpt.formats.retention import UPLOAD_GRACE_S, GcPlan, RetentionPolicy, apply_gc, plan_gc
from moeckpt.formats.storages import open_storage
from moeckpt.trainer.memory_tier import run_id, run_root

from .common import progress
from .params import Text, count, number


def check_run_dir(run_dir: str) -> None:
    """Refuse what is not a run directory: nothing there, a file, a checkpoint, or a directory with no trace of a
    run (no ``step-*`` entry, no staging leftover, no metrics, and on an object store no incomplete upload)."""
    storage = open_storage(run_dir)
    storage.refuse_file()
    if not storage.is_local and storage.stale_uploads(0):
        return  # an object-store prefix whose only trace of a run is a killed save's upload: gc aborts it
    if not storage.exists():
        raise NotCommittedError(f"RUN_DIR {run_dir}: no such run directory")
    names = storage.listdir()
    if INDEX_NAME in names:
        raise NotCommittedError(
            f"RUN_DIR {run_dir}: is a checkpoint, not a run directory; gc works on the directory "
            "that holds step-* checkpoints"
        )
    if not any(
        n.startswith(STEP_PREFIX) or (n.startswith(f".{STEP_PREFIX}") and STAGING_SUFFIX in n) or n == "metrics.jsonl"
        for n in names
    ):
        what = "is empty" if not names else f"holds {len(names)} entries but no step-* checkpoint"
        raise NotCommittedError(f"RUN_DIR {run_dir}: {what}; not a run directory")


def memory_root_of(run_dir: str, parent: str | None) -> str | None:
    """The directory of the run's memory tier on this host, if there is one."""
    rid = run_id(run_dir, create=False)
    root = run_root(parent, rid) if rid is not None else None
    return root if root is not None and os.path.isdir(root) else None


@click.command("gc")
@click.argument("run_dir", type=Text())
@click.option(
    "--keep-last", type=count(1, 10**6), default=3, show_default=True, help="keep the N newest committed steps"
)
@click.option(
    "--keep-every",
    type=count(0),
    default=0,
    show_default=True,
    help="also keep steps that are multiples of K (0: none)",
)
@click.option(
    "--upload-grace",
    type=number(0, 10 * 365 * 86400),
    default=UPLOAD_GRACE_S,
    show_default=True,
    help="abort incomplete multipart uploads (S3) older than this many seconds; 0 aborts all of them",
)
@click.option(
    "--memory-dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    metavar="PATH",
    help="where the run's memory tier lives on this host (as train --memory-dir)  [default: /dev/shm]",
)
@click.option("--dry-run", is_flag=True, help="only print what would be removed")
def command(
    run_dir: str, keep_last: int, keep_every: int, upload_grace: float, memory_dir: str | None, dry_run: bool
) -> None:
    """Remove old committed checkpoints of RUN_DIR beyond the policy, and every uncommitted leftover; on S3, abort
    the multipart uploads that killed saves left (their parts are billed until aborted).

    Do not run it on a run directory while a trainer is saving into it: an in-flight save looks uncommitted (its
    uploads are younger than --upload-grace, and left alone). This host's memory-tier checkpoints of the run
    (train --memory-tier) are removed too; they are never counted as kept checkpoints.
    """
    check_run_dir(run_dir)
    plan = plan_gc(run_dir, RetentionPolicy(keep_last=keep_last, keep_every=keep_every), upload_grace_s=upload_grace)
    verb = "would remove" if dry_run else "removed"
    for name in plan.remove_committed:
        click.echo(f"{verb} {name} (beyond retention)")
    for name in plan.remove_uncommitted:
        click.echo(f"{verb} {name} (uncommitted leftover)")
    for upload in plan.stale_uploads:
        click.echo(
            f"{'would abort' if dry_run else 'aborted'} the upload of {upload.relpath} "
            f"(incomplete multipart upload, started {upload.age_s:.0f} s ago)"
        )
    if not dry_run:
        # stale uploads first (their parts are billed), then one entry at a time, so that a long removal (many objects
        # on S3) shows its progress
        todo = [GcPlan(keep=plan.keep, remove_committed=[], remove_uncommitted=[], stale_uploads=plan.stale_uploads)]
        todo += [GcPlan(keep=plan.keep, remove_committed=[n], remove_uncommitted=[]) for n in plan.remove_committed]
        todo += [GcPlan(keep=plan.keep, remove_committed=[], remove_uncommitted=[n]) for n in plan.remove_uncommitted]
        with progress(len(todo), "gc", unit="entry") as bar:
            for one in todo:
                apply_gc(run_dir, one)
                bar.update(1)
    memory = memory_root_of(run_dir, memory_dir)
    if memory is not None:
        if not dry_run:
            shutil.rmtree(memory, ignore_errors=True)
        click.echo(f"{verb} {memory} (this host's memory-tier checkpoints of the run)")
    click.echo(f"kept {len(plan.keep)} checkpoint(s): {', '.join(plan.keep) or '-'}")
