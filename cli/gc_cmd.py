"""``moeckpt gc``: apply a retention policy to a run directory and remove leftovers of failed saves."""

from __future__ import annotations

import click

from moeckpt.formats.retention import RetentionPolicy, apply_gc, plan_gc


@click.command("gc")
@click.argument("run_dir")
@click.option("--keep-last", type=int, default=3, show_default=True, help="keep the N newest committed steps")
@click.option("--keep-every", type=int, default=0, show_default=True, help="also keep steps that are multiples of K")
@click.option("--dry-run", is_flag=True, help="only print what would be removed")
def command(run_dir: str, keep_last: int, keep_every: int, dry_run: bool) -> None:
    """Remove old committed checkpoints of RUN_DIR beyond the policy, and every uncommitted leftover.

    Do not run it on a run directory while a trainer is saving into it: an in-flight save looks uncommitted.
    """
    plan = plan_gc(run_dir, RetentionPolicy(keep_last=keep_last, keep_every=keep_every))
    verb = "would remove" if dry_run else "removed"
    for name in plan.remove_committed:
        click.echo(f"{verb} {name} (beyond retention)")
    for name in plan.remove_uncommitted:
        click.echo(f"{verb} {name} (uncommitted leftover)")
    if not dry_run:
        apply_gc(run_dir, plan)
    click.echo(f"kept {len(plan.keep)} checkpoint(s): {', '.join(plan.keep) or '-'}")
