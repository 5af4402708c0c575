"""What one extra of pyproject.toml promises, checked in a venv that has that extra alone (and nothing of the
others): ``python .ci/check_extra.py hf WORKDIR`` or ``python .ci/check_extra.py plot WORKDIR DRILL_JSON``.

- ``hf`` (transformers): an export of a checkpoint loads in ``transformers`` whole and computes our logits.
- ``plot`` (matplotlib): a drill's loss curve is drawn to a PNG (``moeckpt.trainer.elastic_drill.plot_drill``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_hf(work: Path) -> None:
    from moeckpt.trainer.hf_check import logits_difference

    for args in (["init", "ck", "--model", "zaya-tiny", "--ep", "2", "--dp", "2"], ["export-hf", "ck", "hf"]):
        subprocess.run(["moeckpt", *args], cwd=work, check=True)
    diff = logits_difference(str(work / "ck"), str(work / "hf"))
    if not diff < 1e-4:
        raise SystemExit(f"check_extra hf: transformers' logits differ from ours by {diff:.3e}")
    print(f"check_extra hf: transformers loads the export whole; max |logits difference| {diff:.2e}")


def check_plot(work: Path, drill_json: Path) -> None:
    from moeckpt.trainer.elastic_drill import DrillResult, plot_drill

    out = work / "drill.png"
    plot_drill(DrillResult.from_json(json.loads(drill_json.read_text())), str(out))
    data = out.read_bytes()
    if not data.startswith(PNG_MAGIC) or len(data) < 10_000:
        raise SystemExit(f"check_extra plot: {out} is not a drawn PNG ({len(data)} bytes)")
    print(f"check_extra plot: {out} drawn ({len(data)} bytes)")


if __name__ == "__main__":
    extra, work = sys.argv[1], Path(sys.argv[2]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    others = {"hf": ("matplotlib", "pytest"), "plot": ("transformers", "pytest")}[extra]
    for name in others:
        if subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True).returncode == 0:
            raise SystemExit(f"check_extra {extra}: {name} is installed, so this is not the {extra} extra alone")
    check_hf(work) if extra == "hf" else check_plot(work, Path(sys.argv[3]))
