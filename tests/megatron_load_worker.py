"""Worker (run under torchrun, 2 ranks, gloo on CPU) that loads checkpoints into Megatron-Core's own GPTModel with
its own ``dist_checkpointing.load``, for the ``export-dcp --mapping megatron`` tests.

``megatron_load_worker.py SPEC OUT``: SPEC is a JSON list of ``{"family": "qwen3_moe"|"mixtral"|"deepseek_v3",
"exported": DIR, "original": DIR}``. At each Megatron layout of :data:`LAYOUTS` (TP 1, then TP 2 x EP 2: Megatron
reshards the one-chunk export to its own layout), the model of :mod:`dcp_workers` that wrote ``original`` is built
twice with every parameter and buffer set to NaN, one loaded from Megatron's own checkpoint, one from the export.
Each rank writes ``OUT.<rank>`` (JSON): per ``<family>@tp<T>ep<E>``, the names whose tensors differ in bits, the
names missing from either, whether the two models' logits are equal, and the export's logits (the rank's vocabulary
slice) as a list, for the test to compare with the writer's.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

# run as a script (torchrun puts its folder first on sys.path), as dcp_workers.py is
from dcp_workers import megatron_dsv3_gpt, megatron_gpt, megatron_logits, run_gloo_worker

BUILDERS = {
    "qwen3_moe": lambda: megatron_gpt(qk_layernorm=True),
    "mixtral": lambda: megatron_gpt(qk_layernorm=False),
    "deepseek_v3": megatron_dsv3_gpt,
}
#: (tensor parallel, expert parallel) of the loading model; the experts are not split by TP (expert TP 1).
LAYOUTS = [(1, 1), (2, 2)]


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


def _compare(family: str, original_dir: str, exported_dir: str) -> dict:
    reference = _loaded(family, original_dir)
    model = _loaded(family, exported_dir)
    original, exported = reference.state_dict(), model.state_dict()
    tensors = [k for k, v in original.items() if isinstance(v, torch.Tensor)]
    logits = megatron_logits(model)[1]
    return {
        "compared": len(tensors),
        "missing": sorted(set(original) ^ set(exported)),
        "differ": [k for k in tensors if k in exported and not torch.equal(_bits(original[k]), _bits(exported[k]))],
        "same_logits": torch.equal(_bits(logits), _bits(megatron_logits(reference)[1])),
        "logits": logits.tolist(),
    }


def main() -> None:
    from megatron.core import parallel_state as ps

    spec_path, out = sys.argv[1], sys.argv[2]

    def body() -> None:
        with open(spec_path, encoding="utf-8") as f:
            cases = json.load(f)
        results = {}
        for tp, ep in LAYOUTS:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1
            )
            for case in cases:
                results[f"{case['family']}@tp{tp}ep{ep}"] = _compare(case["family"], case["original"], case["exported"])
        with open(f"{out}.{dist.get_rank()}", "w", encoding="utf-8") as f:
            json.dump(results, f)

    run_gloo_worker(body)


if __name__ == "__main__":
    main()
