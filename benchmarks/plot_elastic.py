"""Plot what benchmarks/gpu_elastic.sh recorded: loss per layout, and the loss curve across the elastic changes."""

from __future__ import annotations

import glob
import json
import os
import sys


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    summary: dict = {"layouts": {}, "elastic": []}
    for path in sorted(glob.glob(os.path.join(out, "layout-*.jsonl"))):
        rows = [r for r in _read(path) if "loss" in r]
        name = os.path.basename(path)[len("layout-") : -len(".jsonl")]
        a.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name)
        median_tps = sorted(r.get("tokens_per_s", 0) for r in rows)[len(rows) // 2]
        summary["layouts"][name] = {"final_loss": rows[-1]["loss"], "tokens_per_s": median_tps}
    a.set_title("same run, three 2-GPU layouts")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.legend()
    seen = 0
    labels = ["2 GPUs (tp1 ep2 dp2)", "1 GPU (resharded)", "2 GPUs again (ep2 dp2)"]
    for i in (1, 2, 3):
        path = os.path.join(out, f"elastic-{i}.jsonl")
        if not os.path.exists(path):
            continue
        rows = [r for r in _read(path) if "loss" in r][seen:]
        seen += len(rows)
        b.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".", label=labels[i - 1])
        summary["elastic"].append(
            {"phase": labels[i - 1], "steps": [rows[0]["step"], rows[-1]["step"]] if rows else []}
        )
    b.set_title("elastic: lose a GPU, resume resharded, grow back")
    b.set_xlabel("step")
    b.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "gpu_elastic.png"), dpi=110)
    with open(os.path.join(out, "gpu_elastic_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
