"""Check a ``moeckpt demo`` run from its output: the summary table lists every step ok and the PNG it promises
was drawn. ``python3 .ci/check_demo.py LOG DIR``: LOG the demo's output, DIR the directory the demo worked in
(or the temporary directory it made its ``moeckpt-demo-*`` directory in)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: the steps of the demo's summary (cli/demo_cmd.py): a summary with fewer did not run them all.
STEPS = 8
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check(log: Path, where: Path) -> list[str]:
    """What is wrong with the demo run, as lines (none when it did everything it promises)."""
    out = ANSI.sub("", log.read_text(errors="replace"))
    problems = []
    if "moeckpt demo summary" not in out:
        return [f"{log}: no summary table (the demo did not finish)"]
    summary = out.split("moeckpt demo summary", 1)[1].splitlines()[1:]
    rows = [ln.strip() for ln in summary if ln.startswith("  ") and ln.split()[:1] in (["ok"], ["FAIL"])]
    bad = [r for r in rows if not r.startswith("ok")]
    if bad or len(rows) != STEPS:
        problems.append(f"{len(rows)} summary rows, {len(bad)} not ok (want {STEPS} ok): " + " | ".join(bad or rows))
    if "Traceback" in out:
        problems.append("a traceback in the demo's output")
    pngs = [where / "loss.png"] if (where / "loss.png").exists() else sorted(where.glob("moeckpt-demo-*/loss.png"))
    if len(pngs) != 1:
        problems.append(f"{len(pngs)} loss.png files under {where}, want 1")
    else:
        data = pngs[0].read_bytes()
        if not data.startswith(PNG_MAGIC) or len(data) < 10_000:
            problems.append(f"{pngs[0]} is not a drawn PNG ({len(data)} bytes)")
    return problems


if __name__ == "__main__":
    found = check(Path(sys.argv[1]), Path(sys.argv[2]))
    for p in found:
        print(f"check_demo: {p}", file=sys.stderr)
    if not found:
        print("check_demo: every step ok, loss.png drawn")
    sys.exit(1 if found else 0)
