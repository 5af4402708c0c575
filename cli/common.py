"""What every subcommand shares: error reporting, layout and format options, progress bars."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable

import click

from moeckpt.formats.errors import MoeckptError


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
            group.main(standalone_mode=False)
        except click.exceptions.Exit as e:
            code = e.exit_code
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            where = ctx.command_path if ctx is not None else "moeckpt"
            hint = f" (see '{where} --help')" if isinstance(e, click.UsageError) else ""
            click.echo(f"{where}: error: {_one_line(e.format_message())}{hint}", err=True)
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


def layout_options(f: Callable | None = None, *, default_source: bool = False) -> Callable:
    """``--tp/--ep/--dp``: the target parallel layout; each 1 unless given, or with ``default_source`` left
    ``None`` for the command to fill in from its source checkpoint."""
    def add(f: Callable) -> Callable:
        for name, what in (("dp", "data-parallel degree"), ("ep", "expert-parallel degree (divides dp)"),
                           ("tp", "tensor-parallel degree")):
            if default_source:
                f = click.option(f"--{name}", type=click.IntRange(min=1), default=None,
                                 help=f"{what}  [default: the source's]")(f)
            else:
                f = click.option(f"--{name}", type=click.IntRange(min=1), default=1, show_default=True, help=what)(f)
        return f

    return add(f) if f is not None else add


format_option = click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors", "zarr"]),
    default="safetensors",
    show_default=True,
    help="on-disk format of the checkpoint written",
)


def progress(total: int, desc: str, unit: str = "B"):
    """A tqdm bar on stderr; bytes are shown scaled (KB, MB, GB)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1000, file=sys.stderr, leave=False,
                disable=None)
