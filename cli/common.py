"""What every subcommand shares: error reporting, layout and format options, progress bars."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import click

from moeckpt.formats.backend import backend_names
from moeckpt.formats.compression import COMPRESS_HELP, NONE, compress_names
from moeckpt.formats.errors import MoeckptError
from moeckpt.reshard.options import OFFLINE_WORKERS, offline_workers

from .params import count


class Stopped(BaseException):
    """SIGTERM or SIGHUP reached a command that does not handle it itself: unwind (``finally`` blocks run, so
    whatever the command started is stopped) and exit ``128 + signal``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    del frame
    raise Stopped(signum)


#: set by every Ctrl-C this process received: some native code (importing torch) clears the KeyboardInterrupt
#: a Ctrl-C raises, so callers check this after such code (see :func:`check_interrupted`).
INTERRUPTED = threading.Event()


def _interrupt(signum, frame) -> None:
    del signum, frame
    INTERRUPTED.set()
    raise KeyboardInterrupt


def _exit_interrupted(signum, frame) -> None:  # pragma: no cover - runs in a subprocess, in its last moment
    del frame
    sys.stderr.flush()
    os.write(2, b"moeckpt: interrupted\n")
    os._exit(128 + signum)


@contextlib.contextmanager
def interrupts_exit_at_once() -> Iterator[None]:
    """While a command's modules are imported, a Ctrl-C ends the process at once with the one line.

    Nothing has started then that would need cleaning up, and a KeyboardInterrupt raised inside an import is
    unsafe: native code swallows some, and one that passed through code run by ``PyRun_String`` (as embedded
    code is, torch's among it) leaves CPython's "unhandled KeyboardInterrupt" mark set, so that ``python -m
    moeckpt.cli.main`` would end by SIGINT instead of exit code 130 although the interruption was handled.
    Only where :func:`run_main` handles Ctrl-C in the main thread; elsewhere (a test calling the CLI) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not _interrupt:
        yield
        return
    previous = signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def check_interrupted() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that native code swallowed."""
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def run_main(group: click.Group, prepare: Callable[[], None] | None = None) -> None:
    """Run the CLI: every error is one line on stderr and an exit code (2 bad input, 1 a failed check, 130 Ctrl-C,
    128 + N another signal N); never a traceback for a user's mistake or a signal.

    ``prepare`` runs first, inside the same protection (a Ctrl-C during start-up is an interruption too).
    """
    previous = {}
    INTERRUPTED.clear()
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            previous[s] = signal.signal(s, _stop)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _interrupt)
    try:
        code = 0
        try:
            if prepare is not None:
                prepare()
            group.main(prog_name="moeckpt", standalone_mode=False)
        except click.exceptions.Exit as e:
            code = e.exit_code
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            where = ctx.command_path if ctx is not None else "moeckpt"
            hint = f" (see '{where} --help')" if isinstance(e, click.UsageError) else ""
            click.echo(f"moeckpt: error: {_one_line(e.format_message())}{hint}", err=True)
            code = 2
        except click.exceptions.Abort:
            click.echo("moeckpt: interrupted", err=True)
            code = 130
        except MoeckptError as e:
            if getattr(e, "signum", None) is not None:  # the job was stopped by a signal: not an error of input
                click.echo(f"moeckpt: {_one_line(str(e))}", err=True)
            else:
                click.echo(f"moeckpt: error: {_one_line(str(e))}", err=True)
            code = e.exit_code
        except KeyboardInterrupt:
            click.echo("moeckpt: interrupted", err=True)
            code = 130
        except Stopped as e:
            click.echo(f"moeckpt: stopped by {signal.Signals(e.signum).name}", err=True)
            code = 128 + e.signum
    except (KeyboardInterrupt, Stopped) as e:  # a second signal while reporting the first
        code = 130 if isinstance(e, KeyboardInterrupt) else 128 + e.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    sys.exit(code)


#: the largest parallel degree an option takes (a world of 4096 x 4096 ranks is a typo, not a cluster).
MAX_DEGREE = 4096


def layout_options(f: Callable | None = None, *, default_source: bool = False) -> Callable:
    """``--tp/--ep/--dp``: the target parallel layout; each 1 unless given, or with ``default_source`` left
    ``None`` for the command to fill in from its source checkpoint."""

    def add(f: Callable) -> Callable:
        for name, what in (
            ("dp", "data-parallel degree"),
            ("ep", "expert-parallel degree (divides dp)"),
            ("tp", "tensor-parallel degree"),
        ):
            if default_source:
                f = click.option(
                    f"--{name}", type=count(1, MAX_DEGREE), default=None, help=f"{what}  [default: the source's]"
                )(f)
            else:
                f = click.option(f"--{name}", type=count(1, MAX_DEGREE), default=1, show_default=True, help=what)(f)
        return f

    return add(f) if f is not None else add


class FormatChoice(click.Choice):
    """The checkpoint formats, asked of the backend registry when the option is parsed (so a backend registered
    after this module was imported is a choice too)."""

    def __init__(self) -> None:
        super().__init__(backend_names())

    @property
    def choices(self) -> tuple[str, ...]:
        return backend_names()

    @choices.setter
    def choices(self, value: object) -> None:
        del value  # always the registry's


format_option = click.option(
    "--format",
    "fmt",
    type=FormatChoice(),
    default="safetensors",
    show_default=True,
    help="on-disk format of the checkpoint written",
)


def compress_option(f: Callable | None = None, *, default_source: bool = False) -> Callable:
    """``--compress``: lossless compression of the checkpoint written, one of the settings of
    :mod:`moeckpt.formats.compression`; ``none`` unless given, or with ``default_source`` ``None`` (the command
    keeps its source's)."""
    if default_source:
        option = click.option(
            "--compress",
            type=click.Choice(compress_names()),
            default=None,
            help=f"{COMPRESS_HELP}  [default: the source's, where the format written takes it; else none]",
        )
    else:
        option = click.option(
            "--compress", type=click.Choice(compress_names()), default=NONE, show_default=True, help=COMPRESS_HELP
        )
    return option(f) if f is not None else option


#: ``--workers``: parallel file writers.
workers_option = click.option(
    "--workers",
    type=count(1, 256),
    default=offline_workers,
    show_default=f"{OFFLINE_WORKERS}, or the machine's cores if fewer",
    help="parallel file writers",
)


def describe_overwrite(location: str) -> str | None:
    """What ``--overwrite`` is about to remove at ``location`` (one line), or ``None`` when it holds nothing."""
    from moeckpt.formats.checkpoint import STEP_PREFIX, committed_steps
    from moeckpt.formats.index import INDEX_NAME
    from moeckpt.formats.storages import open_storage

    storage = open_storage(location)
    if not storage.exists():
        return None
    try:
        names = storage.listdir()
    except (OSError, MoeckptError):
        return None
    if not names:
        return None
    if INDEX_NAME in names:
        return f"--overwrite: replaced the checkpoint that was at {location} ({len(names)} entries)"
    steps = [s for s, _ in committed_steps(location)]
    if steps:
        others = [n for n in names if not n.startswith(STEP_PREFIX)]
        extra = ""
        if others:
            shown = ", ".join(sorted(others)[:3]) + (", ..." if len(others) > 3 else "")
            extra = f" and {len(others)} other entries ({shown})"
        return (
            f"--overwrite: removed the run directory that was at {location}: {len(steps)} committed "
            f"checkpoint(s) (steps {steps[0]}..{steps[-1]}){extra}"
        )
    shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
    return f"--overwrite: removed what {location} held: {len(names)} entries ({shown})"


def announce_overwrite(location: str, overwrite: bool) -> Callable[[], None]:
    """Note what ``--overwrite`` is about to remove at ``location``; the returned function says it on stderr
    once the command succeeded (a refused command prints only its error line)."""
    line = describe_overwrite(location) if overwrite else None

    def say() -> None:
        if line is not None:
            click.echo(f"moeckpt: {line}", err=True)

    return say


def progress(total: int, desc: str, unit: str = "B"):
    """A tqdm bar on stderr; bytes are shown scaled (KB, MB, GB)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=True,
        unit_divisor=1000,
        file=sys.stderr,
        leave=False,
        disable=None,
    )
