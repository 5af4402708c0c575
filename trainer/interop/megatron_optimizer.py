"""Megatron-Core's AdamW state in an ``export-dcp --mapping megatron``: which sharded keys hold the moments and
masters, and what ``common.pt`` must say for Megatron's optimizer to load them.

Read from megatron-core 0.16.1 (``optimizer/__init__.py``, ``optimizer/optimizer.py``,
``optimizer/distrib_optimizer.py``, ``dist_checkpointing/optimizer.py``) and from what its own ``sharded_state_dict``
saves on CPU with torch's AdamW (no Transformer Engine or Apex). Two forms are written:

* ``plain``: the non-distributed optimizer, ``FP32Optimizer`` for fp32 parameters and
  ``Float16OptimizerWithFloat16Params`` for bf16 ones. Its tensors are ``optimizer.state.exp_avg.<model key>``,
  ``optimizer.state.exp_avg_sq.<model key>`` and, for bf16, the fp32 masters ``optimizer.state.fp32_param.<model
  key>``, each shaped as the model key. Its common state is each sub-optimizer's ``param_groups`` and the step
  (``state.common_step``), under an ``optimizer`` level of its own for the bf16 optimizer.
* ``fully_reshardable``: the ``DistributedOptimizer``'s model-space format (Megatron-LM's
  ``--dist-ckpt-optim-fully-reshardable``): ``optimizer.state.{exp_avg,exp_avg_sq,param}.<model key>``, ``param``
  the fp32 master (the parameter itself when it is fp32); the step is in each param group, and the common state
  names the format (``param_state_sharding_type``), which its ``load_state_dict`` dispatches on.

What decides the common state beyond the tensors:

* ``get_megatron_optimizer`` chains one optimizer for the dense parameters and, when the run's
  ``expert_model_parallel_size`` is above 1, one for the experts: the common state is one sub-optimizer's at the top
  (a chain of one is its sub-optimizer) or ``{0: dense, 1: experts}``. Megatron's own checkpoints do not load
  across the two (measured: ``RuntimeError: Expected 2 entries in state dict, but got 4``), so the export is
  written for one of them (``--megatron-ep``).
* ``_get_param_groups``' standard overrides: parameters of one dimension (norms) and biases get ``wd_mult`` 0, the
  others 1; groups are ordered default first. The plain optimizer merges the saved groups with its own by position
  and refuses another count (``dist_checkpointing.dict_utils.merge``), so the groups written are exactly the ones
  the model's parameters make.
* Each group's hyperparameters: Megatron's (``wd_mult``, ``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``,
  the four it matches groups by; ``max_lr``, ``min_lr``, ``default_config``) and torch AdamW's (``lr``,
  ``betas``, ``eps``, ``weight_decay`` and its flags). torch's ``load_state_dict`` replaces a group's
  hyperparameters with the saved ones, so they must be the run's: no tensor holds them, so they come from
  :class:`MegatronOptimizerConfig`, the checkpoint's record or Megatron-LM's argument defaults (see
  :func:`resolve`).

The step is written as a number where Megatron writes a 0-d tensor (``common_step``): the file stays plain data
(:mod:`moeckpt.formats.dcp.plain_pickle`), and torch's Adam turns a number into the same float32 tensor on load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from ..config import check_settings, setting
from .common import MappingError

#: ``--megatron-optimizer``: parameters only, the non-distributed optimizer, the distributed optimizer's format.
FORMS = ("none", "plain", "fully_reshardable")
#: the fields whose value the export resolves (given, recorded, or Megatron-LM's default), in the notes' order.
HYPERPARAMETERS = ("step", "lr", "min_lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay")
#: Megatron-LM's argument defaults (``--min-lr``, ``--adam-beta1`` ...): what a run that did not set them used.
MEGATRON_DEFAULTS = {"min_lr": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.01}
#: torch's AdamW's own group entries (torch 2.x), which a saved group carries and a load puts back.
_TORCH_ADAMW_FLAGS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


@dataclass(frozen=True, kw_only=True)
class MegatronOptimizerConfig:
    """The Megatron-Core optimizer an export is written for, and the values of its common state that no tensor of a
    moeckpt checkpoint holds; ``export-dcp``'s ``--megatron-*`` options map one-to-one onto these fields."""

    optimizer: str = setting(
        "none",
        "write AdamW's state for Megatron's optimizer: plain (the non-distributed optimizer) or fully_reshardable "
        "(the distributed optimizer's --dist-ckpt-optim-fully-reshardable format); none: the parameters only",
        "optimizer",
        choices=FORMS,
        option="--megatron-optimizer",
    )
    ep: int = setting(
        1,
        "expert-parallel size of the Megatron run that loads it (above 1 its experts have an optimizer of their own)",
        "optimizer",
        min=1,
        max=2**20,
        option="--megatron-ep",
    )
    step: int | None = setting(
        None,
        "AdamW steps the moments have taken; default: the checkpoint's record (an import from Megatron has none)",
        "optimizer",
        min=1,
        max=2**53,
        option="--megatron-step",
    )
    lr: float | None = setting(
        None,
        "the run's peak learning rate (Megatron's --lr: each group's max_lr and lr); default: the checkpoint's record",
        "optimizer",
        min=0,
        max=10,
        option="--megatron-lr",
    )
    min_lr: float | None = setting(
        None, "the run's --min-lr; default: the checkpoint's record, else 0", "optimizer", min=0, max=10,
        option="--megatron-min-lr",
    )  # fmt: skip
    adam_beta1: float | None = setting(
        None, "the run's --adam-beta1; default: the checkpoint's record, else 0.9", "optimizer", min=0, max=1,
        option="--megatron-adam-beta1",
    )  # fmt: skip
    adam_beta2: float | None = setting(
        None, "the run's --adam-beta2; default: the checkpoint's record, else 0.999", "optimizer", min=0, max=1,
        option="--megatron-adam-beta2",
    )  # fmt: skip
    adam_eps: float | None = setting(
        None, "the run's --adam-eps; default: the checkpoint's record, else 1e-8", "optimizer", min=0, max=1,
        min_open=True, option="--megatron-adam-eps",
    )  # fmt: skip
    weight_decay: float | None = setting(
        None, "the run's --weight-decay; default: the checkpoint's record, else 0.01", "optimizer", min=0, max=10,
        option="--megatron-weight-decay",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_settings(self)
        for name in ("adam_beta1", "adam_beta2"):
            if getattr(self, name) == 1:
                raise ValueError(f"{name}=1 must be below 1 (AdamW divides by 1 - beta ** step)")
        if self.optimizer == "none":
            given = [f.name for f in fields(self) if f.name not in ("optimizer", "ep") and getattr(self, f.name)
                     is not None] + (["ep"] if self.ep != 1 else [])  # fmt: skip
            if given:
                raise ValueError(
                    f"{given[0]}={getattr(self, given[0])!r} is given but optimizer='none' writes no optimizer "
                    "state; pass optimizer plain or fully_reshardable too"
                )


class Values(NamedTuple):
    """The resolved common-state values, and where each came from (for the note)."""

    step: int
    lr: float
    min_lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    #: field -> "given", "the checkpoint's record" or "Megatron-LM's default".
    sources: dict[str, str]

    def describe(self) -> str:
        shown = {"step": self.step, "lr": self.lr, "min_lr": self.min_lr, "adam_beta1": self.betas[0],
                 "adam_beta2": self.betas[1], "adam_eps": self.eps, "weight_decay": self.weight_decay}  # fmt: skip
        return ", ".join(f"{k}={shown[k]!r} ({self.sources[k]})" for k in HYPERPARAMETERS)


def recorded(train_state: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint records of its AdamW run (moeckpt's trainer: ``optimizer.steps`` and its
    ``hyperparameters``, ``schedule.config``; an import from torchtitan: the step), by this module's field names."""
    state = train_state if isinstance(train_state, Mapping) else {}
    out: dict[str, Any] = {}
    opt = state.get("optimizer")
    if isinstance(opt, Mapping):
        if type(opt.get("steps")) is int:
            out["step"] = opt["steps"]
        hyper = opt.get("hyperparameters")
        if opt.get("name") == "adamw" and isinstance(hyper, Mapping):
            for mine, theirs in (("adam_beta1", "beta1"), ("adam_beta2", "beta2"), ("adam_eps", "eps"),
                                 ("weight_decay", "weight_decay")):  # fmt: skip
                if type(hyper.get(theirs)) in (int, float):
                    out[mine] = float(hyper[theirs])
    schedule = state.get("schedule")
    config = schedule.get("config") if isinstance(schedule, Mapping) else None
    if isinstance(config, Mapping) and type(config.get("lr")) in (int, float):
        out["lr"] = float(config["lr"])
        if type(config.get("min_lr_ratio")) in (int, float):
            out["min_lr"] = float(config["lr"]) * float(config["min_lr_ratio"])
    return out


def resolve(config: MegatronOptimizerConfig, train_state: Mapping[str, Any] | None, where: str) -> Values:
    """Each common-state value: given (``config``), else the checkpoint's record, else Megatron-LM's default; the
    step and the learning rate have no default (a wrong step restarts AdamW's bias correction)."""
    found = recorded(train_state)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in HYPERPARAMETERS:
        if getattr(config, name) is not None:
            values[name], sources[name] = getattr(config, name), "given"
        elif name in found:
            values[name], sources[name] = found[name], "the checkpoint's record"
        elif name in MEGATRON_DEFAULTS:
            values[name], sources[name] = MEGATRON_DEFAULTS[name], "Megatron-LM's default"
        else:
            what = {"step": "how many AdamW steps its moments have taken", "lr": "the run's learning rate"}[name]
            raise MappingError(
                f"{where}: --megatron-optimizer {config.optimizer} needs {what}, which the checkpoint does not "
                f"record (an import from Megatron-Core: its common.pt is not read); pass --megatron-"
                f"{name.replace('_', '-')}"
            )
    if values["step"] < 1:
        raise MappingError(
            f"{where}: the checkpoint records step {values['step']}: its optimizer has taken no step, so there is no "
            "AdamW state to resume; export without --megatron-optimizer"
        )
    return Values(
        step=int(values["step"]),
        lr=float(values["lr"]),
        min_lr=float(values["min_lr"]),
        betas=(float(values["adam_beta1"]), float(values["adam_beta2"])),
        eps=float(values["adam_eps"]),
        weight_decay=float(values["weight_decay"]),
        sources=sources,
    )


def state_roles(form: str, dtype: str) -> dict[str, str]:
    """The optimizer states a Megatron tensor of parameters of ``dtype`` has in ``form``: Megatron's state name
    (``optimizer.state.<name>.<key>``) -> the moeckpt role it is read from (``param``: the parameter itself)."""
    out = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    if form == "plain" and dtype != "float32":
        out["fp32_param"] = "master"
    elif form == "fully_reshardable":
        # the distributed optimizer keeps an fp32 main copy of every parameter shard: the master, or for an fp32
        # parameter its own values (the shard it steps is a view of the parameter)
        out["param"] = "param" if dtype == "float32" else "master"
    return out


class Group(NamedTuple):
    """What Megatron groups a parameter by (beyond its learning-rate overrides, which are none here)."""

    expert: bool
    no_weight_decay: bool


def groups_of(params: Iterable[Group], ep: int) -> list[list[Group]]:
    """Each sub-optimizer's param groups, in Megatron's order, from its parameters' groups (``expert``: a routed
    expert's). The dense optimizer's, then (expert-parallel runs only) the experts', whose groups say
    ``is_expert_parallel``: without expert parallelism, Megatron steps the experts with the dense parameters. Within
    one, the default group (``wd_mult`` 1) before the one without weight decay, each only where some parameter
    falls in it."""
    keys = {Group(p.expert and ep > 1, p.no_weight_decay) for p in params}
    subs = [[Group(expert, no_wd) for no_wd in (False, True) if Group(expert, no_wd) in keys]
            for expert in ((False, True) if ep > 1 else (False,))]  # fmt: skip
    return [groups for groups in subs if groups]


def _group(key: Group, v: Values) -> dict[str, Any]:
    """One param group as Megatron's ``_get_param_groups`` makes it and torch's AdamW completes it."""
    return {
        "is_expert_parallel": key.expert,
        "default_config": True,
        "wd_mult": 0.0 if key.no_weight_decay else 1.0,
        "lr_mult": 1.0,
        "is_decoupled_lr": False,
        "max_lr": v.lr,
        "min_lr": v.min_lr,
        "lr": v.lr,
        "betas": v.betas,
        "eps": v.eps,
        "weight_decay": v.weight_decay,
        **_TORCH_ADAMW_FLAGS,
    }


def common_state(form: str, dtype: str, subs: list[list[Group]], v: Values) -> dict[Any, Any]:
    """The ``optimizer`` entry of ``common.pt``: what each sub-optimizer's ``sharded_state_dict`` leaves in the
    common state (its ``ShardedTensor`` leaves go to the DCP files), one sub-optimizer's at the top or keyed by
    its index."""

    def one(groups: list[Group]) -> dict[str, Any]:
        made = [_group(g, v) for g in groups]
        if form == "fully_reshardable":
            for g in made:  # DistributedOptimizer.state_dict(): the step in each group, as the float .item() gives
                g["step"] = float(v.step)
            return {"optimizer": {"param_groups": made}, "param_state_sharding_type": form}
        inner = {"state": {"common_step": float(v.step)}, "param_groups": made}
        # Float16OptimizerWithFloat16Params nests torch's state dict under "optimizer" (its masters are sharded)
        return inner if dtype == "float32" else {"optimizer": inner}

    made = [one(groups) for groups in subs]
    # a chained optimizer's sub-optimizers are keyed by their index (ChainedOptimizer.sharded_state_dict)
    return made[0] if len(made) == 1 else dict(enumerate(made))


def content_metadata(form: str) -> dict[str, Any]:
    """What ``dist_checkpointing.load_content_metadata`` gives a loader: the ``metadata`` its model's and optimizer's
    ``sharded_state_dict`` must be asked with to read this export (no ``chained_N.`` prefix, experts stacked)."""
    out: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if form == "fully_reshardable":
        out["distrib_optim_sharding_type"] = form
    return out


def check_dtype(form: str, dtype: str, where: str) -> None:
    """Refuse parameters Megatron's optimizer keeps more state for than moeckpt holds."""
    if form != "none" and dtype not in ("float32", "bfloat16"):
        raise MappingError(
            f"{where}: the parameters are {dtype}; Megatron's optimizer state is written for fp32 or bf16 parameters "
            "(an fp16 run also keeps a loss scale, which a moeckpt checkpoint does not hold)"
        )
