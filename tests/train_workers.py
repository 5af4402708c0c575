"""Module-level worker functions for the multi-process trainer tests (spawned processes import them by name)."""

from __future__ import annotations

import torch


def train_runs(rank: int, configs: list[dict]) -> None:
    """Run each train config in turn on this rank of a gloo world (results land in each run's metrics.jsonl)."""
    from moeckpt.trainer.train import TrainConfig, train

    torch.set_num_threads(1)
    for cfg in configs:
        train(TrainConfig.from_json(cfg))


def eval_run(rank: int, config: dict, out: str) -> None:
    """Evaluate a checkpoint on this rank; rank 0 writes the loss to ``out``."""
    import json

    from moeckpt.trainer.evaluate import EvalConfig, evaluate

    torch.set_num_threads(1)
    loss = evaluate(EvalConfig(**config))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"loss": loss}, f)
