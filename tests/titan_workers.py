"""torchtitan's own checkpoint manager saving and loading the moeckpt format (run under torchrun, gloo on CPU).

The manager is ``tests/titan_manager.py``'s ``MoeckptCheckpointManager`` (the subclass docs/library.md shows);
everything around it is torchtitan's, built as its trainer builds it: the tiny Qwen3-MoE parallelized by its own
``parallelize_qwen3`` (FSDP2 x TP x EP), its ``OptimizersContainer`` (AdamW, from ``default_adamw``) with Qwen3-MoE's
load-balancing hook, its ``LRSchedulersContainer`` (warmup), its ``ParallelAwareDataloader`` (as
``JsonStateDataloader``) over a seeded token stream, and a train state like its ``Trainer``'s. A step is what
torchtitan's trainer does but for the backward: flex attention has none on CPU, so the forward runs under no_grad
(its MoE layers count tokens per expert, which the hook turns into expert-bias updates) and the gradients are
seeded random tensors drawn from the step number, the same on any mesh.

``save OUT DP TP EP ASYNC_MODE``: two steps, the manager saving after each (``OUT/checkpoint/step-{1,2}``); then
what step 2 saved, as full tensors (model and optimizer state), the logits of a fixed batch and, after a third
step, the parameters it gives, into ``OUT/ref.safetensors`` and ``OUT/ref.json``. First, the same save with
torchtitan's stock dataloader (its state is pickle bytes, stored as bytes): what it raised, if anything, and what
it left go into ``ref.json``.

``load OUT DP TP EP REPORT [BASE]``: the same run on a mesh of its own, from other initial weights, then
``manager.load()``: from ``OUT``'s checkpoint folder (a resume), or with ``BASE`` a new run there whose
``initial_load_path`` is ``OUT``'s step 2 (its manager then saves step 3 into ``BASE``). Each rank writes
``REPORT.rank<r>.json``: which tensors differ from what was saved (bit for bit), the restored train state, lr
schedule, param groups and data position, the logits' difference, and which parameters differ after a third step.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader

from tests.dcp_workers import TINY, _noise, run_gloo_worker, torchtitan_config, torchtitan_logits
from tests.titan_manager import JsonDataloaderState, MoeckptCheckpointManager

SEQ, BATCH = 16, 2


class JsonStateDataloader(JsonDataloaderState, ParallelAwareDataloader):
    """torchtitan's dataloader over any dataset, its state as JSON (the text dataloader needs a tokenizer)."""


class TrainState:
    """What torchtitan's ``Trainer`` saves as ``train_state`` (its ``state_dict`` / ``load_state_dict``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


class TokenStream(IterableDataset):
    """One data-parallel rank's samples of a seeded token stream; its position is its state (as torchtitan's
    ``HuggingFaceTextDataset`` keeps ``sample_idx``)."""

    def __init__(self, dp_rank: int, dp_world: int) -> None:
        self.dp_rank, self.dp_world, self.sample_idx = dp_rank, dp_world, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 + self.sample_idx * self.dp_world + self.dp_rank)
            self.sample_idx += 1
            yield torch.randint(0, TINY["vocab"], (SEQ,), generator=g)

    def state_dict(self) -> dict:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, sd: dict) -> None:
        self.sample_idx = sd["sample_idx"]


class Run:
    """The model, optimizers, lr schedulers, dataloader, train state and manager on one mesh."""

    def __init__(
        self,
        out: str,
        dp: int,
        tp: int,
        ep: int,
        *,
        seed: int,
        async_mode: str = "disabled",
        folder: str = "checkpoint",
        initial_load_path: str | None = None,
        dataloader_cls=JsonStateDataloader,
    ):
        from torchtitan.components.optimizer import LRSchedulersContainer
        from torchtitan.components.optimizer.optimizer import default_adamw, register_moe_load_balancing_hook
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims, parallel_dims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        parallel_dims.device_type = "cpu"  # torchtitan picks "cuda" when it finds no accelerator
        dims = ParallelDims(
            dp_replicate=1,
            dp_shard=dp,
            cp=1,
            tp=tp,
            pp=1,
            ep=ep,
            world_size=dist.get_world_size(),
            spmd_backend="partial_dtensor",
        )
        dims.build_mesh()
        dist_utils.set_spmd_backend("partial_dtensor")  # as the trainer does before it builds the model
        par = ParallelismConfig(
            data_parallel_shard_degree=dp,
            tensor_parallel_degree=tp,
            expert_parallel_degree=ep,
            spmd_backend="partial_dtensor",
        )
        cfg = torchtitan_config()
        set_qwen3_sharding_config(cfg, enable_sp=par.enable_sequence_parallel, enable_ep=ep > 1)
        with torch.device("meta"):
            model = cfg.build()
        # fp32 parameters in the forward (torchtitan's mixed_precision_param option): logits comparable across meshes
        parallelize_qwen3(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=par,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder=out,
        )
        model.to_empty(device="cpu")
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            model.init_weights()
            for _, p in sorted(model.named_parameters()):  # from seeded full tensors: replicas hold the same values
                p.copy_(_noise(p, 0.1, g))
        model.train()
        self.model = model
        self.optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
        register_moe_load_balancing_hook(self.optimizers, [model], dims)  # Qwen3-MoE's post_optimizer_build_fn
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=8
        )
        batch = dims.get_mesh("batch") if dims.dp_enabled else None
        self.dp_rank = batch.get_local_rank() if batch is not None else 0
        self.dataloader = dataloader_cls(
            TokenStream(self.dp_rank, dp), dp_rank=self.dp_rank, dp_world_size=dp, batch_size=BATCH
        )
        self.train_state = TrainState()
        self.manager = MoeckptCheckpointManager.Config(
            enable=True,
            folder=folder,
            interval=1,
            async_mode=async_mode,
            initial_load_path=initial_load_path,
            initial_load_model_only=False,
        ).build(
            dataloader=self.dataloader,
            model_parts=[model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
            base_folder=out,
        )
        self.batches = None

    def step(self) -> torch.Tensor:
        """One training step; returns its batch."""
        if self.batches is None:  # made after a load, as the trainer's batch generator is
            self.batches = iter(self.dataloader)
        tokens = next(self.batches)
        self.train_state.step += 1
        forward(self.model, tokens)
        g = torch.Generator().manual_seed(100 + self.train_state.step)
        for _, p in sorted(self.model.named_parameters()):
            p.grad = _noise(p, 0.01, g)
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        self.train_state.ntokens_seen += tokens.numel()
        return tokens

    def tensors(self) -> dict[str, torch.Tensor]:
        """Full tensors of the model's state dict and of the optimizer's flat state (collective)."""
        out = {f"model/{k}": _full(v) for k, v in sorted(self.model.state_dict().items())}
        out.update(
            {
                f"optim/{k}": _full(v)
                for k, v in sorted(self.optimizers.state_dict().items())
                if isinstance(v, torch.Tensor)
            }
        )
        return out

    def values(self) -> dict:
        """The non-tensor state torchtitan saves: train state, lr schedule, param groups, data position."""
        return {
            "train_state": self.train_state.state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "lr": self.lr_schedulers.get_metrics(),
            "param_groups": {k: v for k, v in self.optimizers.state_dict().items() if not isinstance(v, torch.Tensor)},
            "dataloader": json.loads(self.dataloader.state_dict()[self.dataloader._rank_id]),
        }

    def logits(self) -> torch.Tensor:
        tokens = torch.randint(0, TINY["vocab"], (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
        self.model.eval()  # a read: no tokens counted for load balancing
        out = forward(self.model, tokens)
        self.model.train()
        return out


def forward(model, tokens: torch.Tensor) -> torch.Tensor:
    out = _full(torchtitan_logits(model, tokens))
    for m in model.modules():  # FSDP's root keeps its parameters gathered until a backward would free them
        if isinstance(m, FSDPModule):
            m.reshard()
    return out


def _full(t) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def _json(value):
    return json.loads(json.dumps(value))  # tuples as lists, as they come back from any checkpoint


def save(out: str, dp: int, tp: int, ep: int, async_mode: str) -> None:
    from safetensors.torch import save_file

    stock = Run(out, dp, tp, ep, seed=1, folder="stock", dataloader_cls=ParallelAwareDataloader)
    stock.step()
    try:
        stock.manager.save(1)
        stock_error = ""
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException, carrying our line
        stock_error = str(e)
    stock.manager.close()
    run = Run(out, dp, tp, ep, seed=1, async_mode=async_mode)
    run.manager.load()  # a fresh start: nothing there yet
    for _ in range(2):
        run.step()
        run.manager.save(run.train_state.step)
    run.manager.maybe_wait_for_saving()
    ref = run.tensors()
    values = _json(run.values())
    ref["logits"] = run.logits()
    batch3 = run.step()
    ref.update({f"step3/{k}": v for k, v in run.tensors().items() if k.startswith("model/")})
    batches = [None] * dist.get_world_size()
    dist.all_gather_object(batches, (run.dp_rank, batch3.tolist()))
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "ref.safetensors"))
        with open(os.path.join(out, "ref.json"), "w") as f:
            json.dump(
                {
                    "saved": values,
                    "after_step3": _json(run.values()),
                    "batch3": dict(batches),
                    "stock_error": stock_error,
                    "stock_dir": os.listdir(os.path.join(out, "stock")),
                },
                f,
            )
    run.manager.close()


def load(src: str, dp: int, tp: int, ep: int, report: str, base: str | None) -> None:
    """Resume from ``src``'s checkpoint folder (torchtitan's fault-tolerance branch) or, with ``base``, start a run
    there from ``src``'s step 2 (its ``initial_load_path``) and let the manager save step 3 into it."""
    from safetensors.torch import load_file

    ref = load_file(os.path.join(src, "ref.safetensors"))
    initial = None if base is None else os.path.join(src, "checkpoint", "step-2")
    run = Run(base or src, dp, tp, ep, seed=2, initial_load_path=initial)
    before = run.tensors()
    found = run.manager.load()
    got = run.tensors()
    saved = {k: v for k, v in ref.items() if k.startswith(("model/", "optim/"))}
    rep: dict = {
        "loaded": found,
        "values": _json(run.values()),
        "dp_rank": run.dp_rank,
        "differed_before_load": sorted(k for k in saved if k in before and not _bits_equal(before[k], saved[k])),
        "missing": sorted(set(saved) - set(got)),
        "extra": sorted(set(got) - set(saved)),
        "unequal": sorted(k for k in saved if k in got and not _bits_equal(got[k], saved[k])),
        "logits_max_diff": float((run.logits() - ref["logits"]).abs().max()),
    }
    rep["batch3"] = run.step().tolist()
    step3 = {k: v for k, v in run.tensors().items() if k.startswith("model/")}
    rep["step3_unequal"] = sorted(k for k in step3 if not _bits_equal(step3[k], ref[f"step3/{k}"]))
    rep["after_step3"] = _json(run.values())
    if base is not None:
        rep["saved_step3"] = run.manager.save(run.train_state.step)
    with open(f"{report}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(rep, f)
    run.manager.close()


def main() -> None:
    kind, out, dp, tp, ep = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])

    def body() -> None:
        if kind == "save":
            save(out, dp, tp, ep, sys.argv[6])
        else:
            load(out, dp, tp, ep, sys.argv[6], sys.argv[7] if len(sys.argv) > 7 else None)

    run_gloo_worker(body)


if __name__ == "__main__":
    main()
