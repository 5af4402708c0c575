"""What every subcommand shares: error reporting, layout and format options, progress bars."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

from moeckpt.formats.backend import backend_names
from moeckpt.formats.errors import MoeckptError


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that saves in progress clean up (abort their S3 uploads) on the way
    out; not a KeyboardInterrupt, which click would report as an abort."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises in the main thread for the duration, so a command writing a checkpoint unwinds like on Ctrl-C:
    its uploads in flight are aborted and its staging data removed (the default action would kill it on the spot,
    leaving incomplete S3 multipart uploads billed). Commands that launch processes keep their own handling."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_main(group: click.Group) -> None:
    """Run the CLI; a :class:`MoeckptError` becomes one line on stderr and its exit code (2 bad input, 1 check)."""
    try:
        group.main(standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except MoeckptError as e:
        click.echo(f"moeckpt: error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except _Terminated:
        click.echo("terminated", err=True)
        sys.exit(128 + signal.SIGTERM)
    sys.exit(0)


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


class FormatChoice(click.Choice):
    """The checkpoint formats, asked of the backend registry when the option is parsed (so a backend registered
    after this module was imported is a choice too)."""

    def __init__(self) -> None:
        super().__init__(backend_names())

    @property  # type: ignore[override]
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


def progress(total: int, desc: str, unit: str = "B"):
    """A tqdm bar on stderr; bytes are shown scaled (KB, MB, GB)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1000, file=sys.stderr, leave=False,
                disable=None)
