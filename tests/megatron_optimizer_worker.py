"""Worker (torchrun, 2 ranks) that trains Megatron-Core's own GPTModel with Megatron's own optimizer and checkpoints
it, for the tests of ``export-dcp --mapping megatron --megatron-optimizer`` (megatron-core 0.16.1).

``megatron_optimizer_worker.py write SPEC`` and ``... load SPEC OUT``. SPEC is a JSON list of cases, each
``{"name", "family", "form", "dtype", "tp", "ep", "own", "exported"}`` (:data:`FORMS` names the optimizer a form
is; ``dtype`` ``fp32`` or ``bf16``; ``tp`` and ``ep`` Megatron's layout over the 2 ranks, data parallel the rest).

* ``write``: for each case, the family's tiny model of :mod:`dcp_workers` at that layout, wrapped as Megatron-LM
  wraps it (``Float16Module`` for bf16, Megatron's ``DistributedDataParallel``), its optimizer from
  ``get_megatron_optimizer`` (AdamW, lr 1e-3, betas 0.9/0.95, weight decay 0.1, clipping at 1.0), two training
  steps on seeded tokens (each data-parallel rank its own), then ``dist_checkpointing.save`` of the model's and the
  optimizer's sharded state dicts into ``own``, with the content metadata Megatron-LM saves.
* ``load``: for each case, two fresh models and optimizers at the same layout, every float value NaN before
  the load (the optimizer built on the NaN model: masters NaN too); one loads ``own``, the other ``exported``,
  each asking with the content metadata its checkpoint holds (``dist_checkpointing.load_content_metadata``), as
  Megatron-LM does. Then one more training step on each, on the same tokens. Each rank writes ``OUT.<rank>``
  (JSON): per case, the values compared after the load and after the step (model parameters, and per
  sub-optimizer its main parameters, moments, steps and param groups), those that differ in bits, and the loss
  of the step.

On a machine without CUDA, Megatron-Core 0.16.1 needs more than :func:`dcp_workers.megatron_gpt`'s shims to train
and checkpoint (each found by running it, changing no computation; the first two only without CUDA, the third only
without Transformer Engine or Apex):

* its optimizers make small tensors with ``device='cuda'`` (``FP32Optimizer._scale``, ``found_inf`` and friends of
  the mixed-precision optimizers, the gradient norm's buffers in ``clip_grads.py``, ``utils.py``'s bucket
  tensors) and move some with ``.cuda()`` (``distrib_optimizer.py``'s gather): made on the CPU here;
* they tell parameters by ``Tensor.type()`` strings (``'torch.cuda.BFloat16Tensor'`` in
  ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer``, ``'torch.cuda.FloatTensor'`` asserted in
  ``clip_grads.py``): a CPU tensor answers with the CUDA type name of its dtype;
* the ``DistributedOptimizer`` on torch's AdamW (no Transformer Engine or Apex) cannot load a checkpoint as
  Megatron-Core 0.16.1 ships it: a fresh one refuses to build its loading state dict (``state_dict()`` asserts one
  step count over its states, ``distrib_optimizer.py:642``, and it has none), and one with states fails the
  ``fully_reshardable`` load (``load_parameter_state_from_fully_reshardable`` leaves torch's ``step`` out of the
  tensors it hands ``_set_main_param_and_optimizer_states``, which copies every state key:
  ``KeyError: 'step'``, ``distrib_optimizer.py:940``). The loader initialises the states with Megatron's own
  ``_init_optimizer_states_with_dummy_values()`` and hands the step it already holds along with the tensors; the
  step itself is set by ``load_state_dict`` from the checkpoint, as Megatron does.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

# run as a script (torchrun puts its folder first on sys.path), as dcp_workers.py is
from dcp_workers import megatron_dsv3_gpt, megatron_gpt, run_gloo_worker

#: form -> (use_distributed_optimizer, the distributed optimizer's sharding type)
FORMS = {"plain": (False, None), "fully_reshardable": (True, "fully_reshardable")}
#: the optimizer's hyperparameters (not Megatron-LM's defaults, so that an export written with those would differ)
OPTIMIZER = {"lr": 1e-3, "min_lr": 1e-4, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8, "weight_decay": 0.1}
STEPS = 2
_CUDA_TYPES = {torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def _cpu_shims() -> None:
    """What Megatron-Core's optimizers need on a machine without CUDA (see the module docstring): tensors made or
    moved to CUDA made on the CPU, CUDA type names for CPU tensors."""
    from torch.overrides import TorchFunctionMode

    def on_cpu(device):
        if isinstance(device, str) and device.startswith("cuda"):
            return "cpu"
        if isinstance(device, torch.device) and device.type == "cuda":
            return torch.device("cpu")
        return device

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                return _CUDA_TYPES.get(args[0].dtype) or func(*args)
            if func is torch.Tensor.cuda:
                return args[0]
            if "device" in kwargs:
                kwargs["device"] = on_cpu(kwargs["device"])
            return func(*args, **kwargs)

    CudaOnCpu().__enter__()  # for the rest of the worker's life


def _torch_adamw_shim() -> None:
    """The distributed optimizer's ``fully_reshardable`` load on torch's AdamW (see the module docstring): the step
    torch keeps in each state handed along with the loaded tensors, copied onto itself."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    own = DistributedOptimizer._set_main_param_and_optimizer_states

    def with_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main].get("step")
        if step is not None and "step" not in tensors:
            tensors = {**tensors, "step": step}  # copied onto itself: load_state_dict sets it from the checkpoint
        return own(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = with_step


def content_metadata(form: str) -> dict:
    """The ``metadata`` the writer asks ``sharded_state_dict`` with and saves as the content metadata: no
    ``chained_N.`` prefix on the optimizer's keys, experts stacked, and the distributed optimizer's format. Written
    out here, not taken from moeckpt: Megatron's own checkpoint must not depend on the code under test."""
    out = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if FORMS[form][1]:
        out["distrib_optim_sharding_type"] = FORMS[form][1]
    return out


def build(case: dict, nan: bool = False):
    """The case's model, wrapped as Megatron-LM wraps it, and its optimizer, at the case's layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    bf16 = case["dtype"] == "bf16"
    distributed, _ = FORMS[case["form"]]
    tp, ep = case["tp"], case["ep"]
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1)  # fmt: skip
    fields = {
        "tensor_model_parallel_size": tp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": 1,
        "sequence_parallel": tp > 1,  # Megatron refuses to train MoE layers with TP but without it
        "bf16": bf16,
        "params_dtype": torch.bfloat16 if bf16 else torch.float32,
    }
    if case["family"] == "deepseek_v3":
        model = megatron_dsv3_gpt(**fields)
    else:
        model = megatron_gpt(qk_layernorm=case["family"] == "qwen3_moe", **fields)
    model.train()
    if nan:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point():
                    t.fill_(float("nan"))
    config = model.config
    if bf16:
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", bf16=bf16, params_dtype=fields["params_dtype"], use_distributed_optimizer=distributed,
            clip_grad=1.0, **OPTIMIZER,
        ),
        [ddp],
    )  # fmt: skip
    return model, ddp, opt


def train_step(ddp, opt, step: int) -> float:
    """One training step of Megatron's own loop (forward, backward, gradient sync, optimizer step) on tokens
    seeded by the step and the data-parallel rank."""
    from megatron.core import parallel_state as ps

    seed = 1000 * step + ps.get_data_parallel_rank()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(16).repeat(2, 1)
    mask = torch.triu(torch.ones(16, 16), diagonal=1).bool()[None, None]
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(tokens, positions, attention_mask=mask, labels=labels).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError(f"Megatron's optimizer skipped step {step}")
    return float(loss)


def _sharded(model, opt, metadata: dict, loading: str | None = None) -> dict:
    """The state Megatron-LM checkpoints: its model's and its optimizer's sharded state dicts; ``loading``: the
    form of the optimizer about to load."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    msd = model.sharded_state_dict(metadata=metadata)
    if loading is not None and FORMS[loading][0] and not HAVE_APEX_OR_TE:
        for sub in opt.chained_optimizers:  # see the module docstring: a fresh one has no states to ask with
            sub._init_optimizer_states_with_dummy_values()
    return {"model": msd, "optimizer": opt.sharded_state_dict(msd, is_loading=loading is not None, metadata=metadata)}


def write(case: dict) -> None:
    from megatron.core import dist_checkpointing

    model, ddp, opt = build(case)
    for step in range(STEPS):
        train_step(ddp, opt, step)
    metadata = content_metadata(case["form"])
    os.makedirs(case["own"], exist_ok=True)
    dist_checkpointing.save(_sharded(model, opt, metadata), case["own"], content_metadata=metadata)


def _loaded(case: dict, path: str):
    from megatron.core import dist_checkpointing

    model, ddp, opt = build(case, nan=True)
    metadata = dist_checkpointing.load_content_metadata(path)
    state = dist_checkpointing.load(_sharded(model, opt, metadata, case["form"]), path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return model, ddp, opt


def snapshot(model, opt) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """What a resumed run holds: the model's parameters and buffers, and for each sub-optimizer the main
    parameters it steps (fp32 masters, or distributed shards), its AdamW states (moments and step) and its param
    groups' hyperparameters."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    groups: dict[str, object] = {}
    for i, sub in enumerate(opt.chained_optimizers):
        inner = sub.optimizer
        for g, group in enumerate(inner.param_groups):
            groups[f"{i}.{g}"] = {k: v for k, v in group.items() if k != "params"}
            for j, param in enumerate(group["params"]):
                tensors[f"opt{i}.group{g}.{j}.main"] = param
                for key, value in inner.state[param].items():
                    tensors[f"opt{i}.group{g}.{j}.{key}"] = value
    return tensors, groups


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in a if k not in b or a[k].dtype != b[k].dtype or not torch.equal(_bits(a[k]), _bits(b[k])))


def compare(case: dict) -> dict:
    own_model, own_ddp, own_opt = _loaded(case, case["own"])
    model, ddp, opt = _loaded(case, case["exported"])
    out: dict = {}
    for when in ("loaded", "stepped"):
        if when == "stepped":
            out["loss"] = [train_step(own_ddp, own_opt, STEPS), train_step(ddp, opt, STEPS)]
        (want, want_groups), (got, got_groups) = snapshot(own_model, own_opt), snapshot(model, opt)
        out[when] = {
            "compared": len(want),
            "missing": sorted(set(want) ^ set(got)),
            "differ": _differ(want, got),
            "nan": sorted(k for k, v in got.items() if v.is_floating_point() and bool(torch.isnan(v).any())),
            "steps": sorted({float(v) for k, v in got.items() if k.endswith(".step")}),
            "groups_equal": repr(want_groups) == repr(got_groups),
            "groups": repr(got_groups) if repr(want_groups) != repr(got_groups) else "",
            "optimizers": [type(sub).__name__ for sub in opt.chained_optimizers],
        }
    return out


def main() -> None:
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    mode, spec = sys.argv[1], sys.argv[2]
    if not torch.cuda.is_available():
        _cpu_shims()
    if not HAVE_APEX_OR_TE:
        _torch_adamw_shim()

    def body() -> None:
        with open(spec, encoding="utf-8") as f:
            cases = json.load(f)
        if mode == "write":
            for case in cases:
                write(case)
            return
        results = {case["name"]: compare(case) for case in cases}
        with open(f"{sys.argv[3]}.{dist.get_rank()}", "w", encoding="utf-8") as f:
            json.dump(results, f)

    run_gloo_worker(body)


if __name__ == "__main__":
    main()
