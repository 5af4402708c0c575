"""The phases of a (re)start, for ``metrics.jsonl``: when the worker process started, joined the world, had its
model built, had its state loaded, and finished its first step.

After a failure the time to the first new step splits into: failure detection and the agent's teardown and
rendezvous (the agent's records, ``MOECKPT_AGENT_EVENTS``), then this process's start (interpreter and imports), the
device and process-group init, the model build, the load and the first step (these marks). Times are wall-clock
(``time.time()``) so that they line up with the agent's and with a drill's kill.
"""

from __future__ import annotations

import os
import time

__all__ = ["PHASES", "phase_durations", "process_start_time"]

#: the marks of a start, in order; the first is this process's creation.
PHASES = ("process_start", "entered", "world_joined", "model_built", "loaded", "first_step")


def process_start_time() -> float | None:
    """When this process was created (wall clock, about 10 ms resolution), from Linux ``/proc``; else ``None``."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def phase_durations(marks: dict[str, float | None]) -> dict[str, float]:
    """Seconds between consecutive marks, named by the later one: ``{"entered": imports, "world_joined":
    process-group init, "model_built": ..., "loaded": ..., "first_step": ...}`` (missing marks are skipped)."""
    out: dict[str, float] = {}
    previous = None
    for name in PHASES:
        t = marks.get(name)
        if t is None:
            continue
        if previous is not None:
            out[name] = round(t - previous, 4)
        previous = t
    return out
