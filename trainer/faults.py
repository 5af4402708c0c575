"""Fault injection for tests and the demo: ``--inject kill:rank=1,step=12`` and friends.

Real failures are rare and slow to wait for; injecting them at chosen steps makes every recovery path testable
on a laptop. Kinds:

* ``kill``: the rank's process dies at once (``os._exit``), as on a lost node; ``signal=TERM`` sends SIGTERM to
  itself instead (a preemption notice).
* ``hang``: the rank stops making progress (sleeps), so the watchdog must end it.
* ``nan``: the loss becomes NaN at that step, so the NaN policy must roll back.
* ``kill-during-save``: the rank dies in the middle of writing its checkpoint file.
* ``corrupt-file``: after the checkpoint of that step is committed, one byte of the rank's data file is flipped,
  so the next resume must detect it and fall back to the previous checkpoint.
* ``slow``: from that step on, the rank sleeps ``seconds`` before every step (a straggler; elastic drills use it to
  keep a tiny run going while nodes come and go); with ``world=W`` only while the job runs with W ranks (a drill
  keeps its shrunk job going until a new node has joined, then trains on at full speed).

Each fault but ``slow`` fires once per run directory (a marker file records it), so a restarted worker does not
fail again.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from moeckpt.formats.errors import MoeckptError

KINDS = ("kill", "hang", "nan", "kill-during-save", "corrupt-file", "slow")


class FaultSpecError(MoeckptError, ValueError):
    """An ``--inject`` value that cannot be parsed."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault: what, on which rank (None = every rank), at which step."""

    kind: str
    step: int
    rank: int | None = None
    signal: str | None = None
    #: ``slow``: the delay before every step.
    seconds: float = 0.0
    #: ``slow``: only while the job runs with this many ranks (None: at any size).
    world: int | None = None

    @property
    def marker(self) -> str:
        who = "all" if self.rank is None else f"rank{self.rank}"
        return f".fault-{self.kind}-{who}-step{self.step}"

    def applies(self, rank: int, step: int, world: int | None = None) -> bool:
        """Whether the fault acts on ``rank`` at ``step`` in a job of ``world`` ranks: at its step, or for ``slow``
        at every step from it on (in a job of its ``world`` ranks, if it names one)."""
        at = step >= self.step if self.kind == "slow" else step == self.step
        sized = self.world is None or self.world == world
        return at and sized and (self.rank is None or self.rank == rank)


def parse_fault(text: str) -> Fault:
    """``KIND:key=value,...`` with keys ``rank``, ``step`` (required), ``signal`` (kill), ``seconds`` and ``world``
    (slow)."""
    kind, _, rest = text.partition(":")
    if kind not in KINDS:
        raise FaultSpecError(f"--inject {text!r}: unknown fault {kind!r}; known: {', '.join(KINDS)}")
    fields: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key not in ("rank", "step", "signal", "seconds", "world"):
            raise FaultSpecError(
                f"--inject {text!r}: expected rank=N, step=N, signal=TERM, seconds=X or world=W, got {part!r}"
            )
        fields[key] = value
    try:
        step = int(fields["step"])
        rank = int(fields["rank"]) if "rank" in fields else None
    except KeyError:
        raise FaultSpecError(f"--inject {text!r}: step=N is required") from None
    except ValueError:
        raise FaultSpecError(f"--inject {text!r}: rank and step must be integers") from None
    sig = fields.get("signal")
    if sig is not None and (kind != "kill" or sig not in ("TERM", "KILL")):
        raise FaultSpecError(f"--inject {text!r}: signal=TERM|KILL only applies to kill")
    seconds = 0.0
    if kind == "slow" or "seconds" in fields:
        try:
            seconds = float(fields["seconds"])
        except (KeyError, ValueError):
            raise FaultSpecError(f"--inject {text!r}: slow needs seconds=X, a number of seconds >= 0") from None
        if kind != "slow" or not 0 <= seconds <= 3600:
            raise FaultSpecError(f"--inject {text!r}: seconds=X (0 to 3600) only applies to slow")
    world = None
    if "world" in fields:
        try:
            world = int(fields["world"])
        except ValueError:
            raise FaultSpecError(f"--inject {text!r}: world={fields['world']!r} is not a number of ranks") from None
        if kind != "slow" or world < 1:
            raise FaultSpecError(f"--inject {text!r}: world=W (a number of ranks >= 1) only applies to slow")
    return Fault(kind=kind, step=step, rank=rank, signal=sig, seconds=seconds, world=world)


class FaultInjector:
    """Fires the configured faults at the right rank and step, once per run directory."""

    def __init__(self, faults: list[Fault], *, rank: int, marker_dir: str | None, world: int | None = None):
        self.faults = faults
        self.rank = rank
        self.marker_dir = marker_dir
        #: the job's number of ranks (a ``slow`` fault with ``world=W`` acts only when it is W)
        self.world = world

    def _take(self, kind: str, step: int) -> Fault | None:
        for f in self.faults:
            if f.kind == kind and f.applies(self.rank, step) and not self._fired(f):
                self._mark(f)
                return f
        return None

    def _fired(self, fault: Fault) -> bool:
        return self.marker_dir is not None and os.path.exists(os.path.join(self.marker_dir, fault.marker))

    def _mark(self, fault: Fault) -> None:
        if self.marker_dir is None or self.marker_dir.startswith(("s3://", "memory://")):
            return
        os.makedirs(self.marker_dir, exist_ok=True)
        with open(os.path.join(self.marker_dir, fault.marker), "w") as f:
            f.write(f"{time.time()}\n")
            f.flush()
            os.fsync(f.fileno())

    def before_step(self, step: int) -> None:
        """Kill, hang or dawdle at the start of ``step``."""
        for f in self.faults:
            if f.kind == "slow" and f.applies(self.rank, step, self.world):
                time.sleep(f.seconds)
        fault = self._take("kill", step)
        if fault is not None:
            if fault.signal == "TERM":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                os._exit(137)
        if self._take("hang", step) is not None:
            while True:  # a real hang: no progress, no exit; the watchdog must notice
                time.sleep(3600)

    def loss(self, step: int, loss):
        """The loss, or NaN when a ``nan`` fault fires at ``step``."""
        if self._take("nan", step) is not None:
            return loss * float("nan")
        return loss

    def during_save(self, step: int) -> None:
        """Called by the save path after part of the data is written."""
        if self._take("kill-during-save", step) is not None:
            os._exit(137)

    def after_commit(self, step: int, checkpoint_dir: str) -> None:
        """Flip one byte of this rank's data file of a committed local checkpoint."""
        if self._take("corrupt-file", step) is None:
            return
        path = os.path.join(checkpoint_dir, f"rank-{self.rank:05d}.safetensors")
        if not os.path.exists(path):
            return
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
