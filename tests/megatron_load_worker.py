"""Worker (run under torchrun, gloo on CPU) that loads checkpoints into Megatron-Core's own GPTModel with its own
``dist_checkpointing.load``, for the ``export-dcp --mapping megatron`` tests.

``megatron_load_worker.py SPEC OUT``: SPEC is a JSON list of ``{"family": "qwen3_moe"|"mixtral"|"deepseek_v3",
"exported": DIR, "original": DIR}``. For each, the model of :mod:`dcp_workers` (the one that wrote ``original``)
is built twice with every parameter and buffer set to NaN, one loaded from Megatron's own checkpoint, one from the
export; OUT (JSON) gets, per family, the names whose tensors differ in bits, the names missing from either, and
the export's logits (on the writer's tokens) as a list, for the test to compare with the writer's.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

# run as a script (torchrun puts its folder first on sys.path), as dcp_workers.py is
from dcp_workers import exit_without_teardown, megatron_dsv3_gpt, megatron_gpt, megatron_logits

BUILDERS = {
    "qwen3_moe": lambda: megatron_gpt(qk_layernorm=True),
    "mixtral": lambda: megatron_gpt(qk_layernorm=False),
    "deepseek_v3": megatron_dsv3_gpt,
}


def _loaded(family: str, path: str):
    """A fresh model of ``family`` whose every value comes from ``path``: NaN before the load, so a tensor the load
    did not fill cannot pass for one it did."""
    from megatron.core import dist_checkpointing

    model = BUILDERS[family]()
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.fill_(float("nan"))
    state = dist_checkpointing.load(model.sharded_state_dict(), path)
    model.load_state_dict(state)
    return model


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def main() -> None:
    spec_path, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    try:
        results = {}
        with open(spec_path, encoding="utf-8") as f:
            cases = json.load(f)
        for case in cases:
            original = _loaded(case["family"], case["original"]).state_dict()
            model = _loaded(case["family"], case["exported"])
            exported = model.state_dict()
            tensors = [k for k, v in original.items() if isinstance(v, torch.Tensor)]
            results[case["family"]] = {
                "compared": len(tensors),
                "missing": sorted(set(original) ^ set(exported)),
                "differ": [
                    k for k in tensors if k in exported and not torch.equal(_bits(original[k]), _bits(exported[k]))
                ],
                "logits": megatron_logits(model)[1].tolist(),
            }
        with open(out, "w", encoding="utf-8") as f:
            json.dump(results, f)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_without_teardown()


if __name__ == "__main__":
    main()
