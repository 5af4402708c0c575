"""The ``moeckpt`` command: a click group; every subcommand lives in its own module under ``moeckpt.cli``.

Subcommand modules are imported when their command runs (or for ``--help``), not when ``moeckpt`` starts: the
first second of every command is then spent inside its error handling, so even a Ctrl-C while torch is still
being imported ends with one line instead of a traceback.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys


def _interrupted_early(signum, frame) -> None:  # pragma: no cover - timing
    del frame
    os.write(2, b"moeckpt: interrupted\n")
    os._exit(128 + signum)


#: whether this process turned the cyclic collector off for its imports (see _freeze_imports, which turns it on).
_COLLECTOR_OFF = False

# Run as the ``moeckpt`` program (not imported by a test or another tool), a Ctrl-C before the first command even
# starts is one line too; run_main takes over once click is imported. The cyclic collector is off until the
# command's imports are done: they make objects that live as long as the process, and the collector would walk
# all of them again each time their number grew by a quarter.
if os.path.basename(sys.argv[0]) == "moeckpt" or __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_early)
    gc.disable()
    _COLLECTOR_OFF = True

import click  # noqa: E402

from .common import check_interrupted, interrupts_exit_at_once, run_main  # noqa: E402

#: subcommand modules; each defines a click command named ``command`` that is added to the group.
COMMAND_MODULES = {
    "init": "init_cmd",
    "inspect": "inspect_cmd",
    "verify": "verify_cmd",
    "diff": "diff_cmd",
    "gc": "gc_cmd",
    "demo": "demo_cmd",
    "export-hf": "export_hf_cmd",
    "consolidate": "consolidate_cmd",
    "import-hf": "import_hf_cmd",
    "import-dcp": "import_dcp_cmd",
    "export-dcp": "export_dcp_cmd",
    "reshard": "reshard_cmd",
    "train": "train_cmd",
    "eval": "eval_cmd",
}


#: commands whose usual run never imports torch (an export that moves bytes): the others import it with their
#: module, inside the window where a Ctrl-C exits at once. The library imports torch where tensors are made, so
#: without this a command's first tensor would import it later, where a KeyboardInterrupt raised inside torch's
#: import leaves the process to end by SIGINT instead of exit code 130 (:func:`.common.interrupts_exit_at_once`).
TORCH_FREE_COMMANDS = frozenset({"export-hf"})


class _LazyGroup(click.Group):
    """A group that imports a subcommand's module only when that command is looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMAND_MODULES)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["moeckpt.argv"] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        from .preflight import check_s3_reachable

        check_s3_reachable(ctx.meta.get("moeckpt.argv", []))
        return super().invoke(ctx)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = COMMAND_MODULES.get(name)
        if module is None:
            return None
        with interrupts_exit_at_once():
            command = importlib.import_module(f"{__package__}.{module}").command
            if name not in TORCH_FREE_COMMANDS:
                importlib.import_module("torch")
        check_interrupted()  # a Ctrl-C that arrived before (native code may have swallowed its KeyboardInterrupt)
        _freeze_imports()
        check_interrupted()
        return command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="moeckpt")
@click.option("-v", "--verbose", count=True, help="more messages (-vv: torch's own, torchrun's agent included)")
@click.option("-q", "--quiet", count=True, help="fewer messages (-q: no progress lines; -qq: errors only)")
def cli(verbose: int, quiet: int) -> None:
    """Save, reshard and restore Mixture-of-Experts checkpoints (safetensors or zarr, local disk or S3)."""
    from .verbosity import setup

    setup(verbose - quiet)


def all_commands() -> dict[str, click.Command]:
    """Every subcommand, imported (``--help`` listings, tests that walk every option)."""
    commands = {name: cli.get_command(click.Context(cli), name) for name in COMMAND_MODULES}
    return {name: c for name, c in commands.items() if c is not None}


#: whether :func:`_freeze_imports` froze this process's objects.
_FROZEN = False


def _freeze_imports() -> None:
    # The commands' imports (torch above all) leave ~170k long-lived objects that every full collection would walk
    # again: freezing them took the collector from 0.22 s to 0.02 s of a 2.3 s reshard of 1.1 GB, time in which
    # every thread waits on the interpreter lock.
    # A Ctrl-C during the collection would be raised inside some finalizer, which Python reports as "Exception
    # ignored" with a traceback and then carries on: the signal waits until the collection is done.
    # With the collector off during the imports (the program's run) the objects are frozen without a collection
    # first, as the gc module's documentation has it for a server that forks: the garbage frozen with them (a few
    # thousand objects the imports dropped) is less memory than the collection costs time.
    global _FROZEN
    # once per process (tests call main() many times); a flag, as gc.get_freeze_count() walks every frozen object
    if not _FROZEN:
        _FROZEN = True
        blocked = hasattr(signal, "pthread_sigmask")
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            if not _COLLECTOR_OFF:
                gc.collect()
            gc.freeze()
        finally:
            if blocked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    if _COLLECTOR_OFF:
        gc.enable()


def main() -> None:
    run_main(cli)  # replaces the early SIGINT handler


if __name__ == "__main__":
    main()
