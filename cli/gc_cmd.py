"""``moeckpt gc``: apply a retention policy to a run directory and remove leftovers of failed saves."""

from __future__ import annotations

import math

import click

from moeckpt.formats.retention import UPLOAD_GRACE_S, RetentionPolicy, apply_gc, plan_gc


class _Seconds(click.ParamType):
    """A finite, non-negative number of seconds."""

    name = "seconds"

    def convert(self, value, param, ctx) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < 0:
            self.fail(f"{value!r} must be a finite number of seconds >= 0", param, ctx)
        return seconds


@click.command("gc")
@click.argument("run_dir")
@click.option("--keep-last", type=int, default=3, show_default=True, help="keep the N newest committed steps")
@click.option("--keep-every", type=int, default=0, show_default=True, help="also keep steps that are multiples of K")
@click.option("--upload-grace", type=_Seconds(), default=UPLOAD_GRACE_S, show_default=True,
              help="abort incomplete multipart uploads (S3) older than this many seconds; 0 aborts all of them")
@click.option("--dry-run", is_flag=True, help="only print what would be removed")
def command(run_dir: str, keep_last: int, keep_every: int, upload_grace: float, dry_run: bool) -> None:
    """Remove old committed checkpoints of RUN_DIR beyond the policy, and every uncommitted leftover; on S3, abort
    the multipart uploads that killed saves left (their parts are billed until aborted).

    Do not run it on a run directory while a trainer is saving into it: an in-flight save looks uncommitted (its
    uploads are younger than --upload-grace, and left alone).
    """
    plan = plan_gc(run_dir, RetentionPolicy(keep_last=keep_last, keep_every=keep_every), upload_grace_s=upload_grace)
    verb = "would remove" if dry_run else "removed"
    for name in plan.remove_committed:
        click.echo(f"{verb} {name} (beyond retention)")
    for name in plan.remove_uncommitted:
        click.echo(f"{verb} {name} (uncommitted leftover)")
    for upload in plan.stale_uploads:
        click.echo(f"{'would abort' if dry_run else 'aborted'} the upload of {upload.relpath} "
                   f"(incomplete multipart upload, started {upload.age_s:.0f} s ago)")
    if not dry_run:
        apply_gc(run_dir, plan)
    click.echo(f"kept {len(plan.keep)} checkpoint(s): {', '.join(plan.keep) or '-'}")
