"""Training metrics as JSON lines in ``<run-dir>/metrics.jsonl``, one object per optimizer step.

Only one rank (global rank 0) writes. A local run directory gets an appended, flushed line per step, so a crash
loses at most the step in progress; object stores cannot append, so there the whole file is rewritten at each
:meth:`MetricsLog.flush` (the trainer flushes at every checkpoint and at the end). A resumed run appends after the
lines of the interrupted one; steps it repeats appear twice and the last line of a step is the one that counts.
"""

from __future__ import annotations

import json
import os
from typing import Any

from moeckpt.formats.storages import open_storage

__all__ = ["METRICS_FILE", "MetricsLog", "read_metrics"]

#: file name of the metrics log inside the run directory.
METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends one JSON object per step to the run directory's metrics file (a no-op when ``enabled`` is false)."""

    def __init__(self, run_dir: str, *, enabled: bool = True) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self._storage = open_storage(run_dir)
        self._remote = not self._storage.is_local
        self._lines: list[str] = []
        if enabled and self._remote:
            if self._storage.exists(METRICS_FILE):
                self._lines = self._storage.read_bytes(METRICS_FILE).decode().splitlines()
        elif enabled:
            os.makedirs(self._storage.location, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if not self.enabled:
            return
        line = json.dumps(record, separators=(",", ":"))
        if self._remote:
            self._lines.append(line)
            return
        with open(self._storage.path(METRICS_FILE), "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def flush(self) -> None:
        """Make every line written so far durable where the run directory lives."""
        if self.enabled and self._remote:
            self._storage.write_bytes(METRICS_FILE, ("\n".join(self._lines) + "\n").encode())


def read_metrics(run_dir: str, *, events: bool = False) -> list[dict[str, Any]]:
    """The step records of a run's metrics file (local or URL), in file order: a step trained again after a
    resume appears again, and callers that want one record per step keep the last.

    With ``events=True`` also the event records (``{"event": "resume" | "nan_rollback", ...}``) between them.
    """
    storage = open_storage(run_dir)
    if not storage.exists(METRICS_FILE):
        return []
    text = storage.read_bytes(METRICS_FILE).decode()
    # Every record ends with a newline; a last line without one is still being written (a live run) or was cut
    # short (a killed one), so it is left out rather than failing the reader.
    lines = text.split("\n")[:-1]
    rows = [json.loads(line) for line in lines if line.strip()]
    return rows if events else [r for r in rows if "event" not in r]
