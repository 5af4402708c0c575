"""The training run's configuration: one flat, frozen dataclass whose fields carry their own option metadata.

:class:`TrainConfig` is the one source of ``moeckpt train``'s options: every field has a one-line help, a section
(``model``, ``data``, ``optimizer``, ``checkpointing``, ``faults``, ``elastic``), its type, range or choices, and
optionally the option's spelling; ``moeckpt.cli.config_options`` builds the click options from exactly that, and
:meth:`TrainConfig.__post_init__` validates the same ranges, so a value the command line refuses is refused from
Python and from JSON too. The config stays flat (sections are a tag per field) so it travels to the workers as one
JSON object, ``{"model": ..., "run_dir": ..., "lr": ...}``, as torchrun users write it.
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any

from moeckpt.formats.backend import backend_compressions, backend_names
from moeckpt.formats.compression import COMPRESS_HELP, NONE, compress_names

__all__ = [
    "DATA_DTYPES",
    "DTYPES",
    "MUON_SCHEMES",
    "OPTIMIZERS",
    "RESUME_READS",
    "SECTIONS",
    "TrainConfig",
    "check_settings",
    "check_value",
    "required_setting",
    "setting",
]

#: the sections of the config, in the order ``moeckpt train --help`` lists them.
SECTIONS = ("model", "data", "optimizer", "checkpointing", "faults", "elastic")
#: ``--dtype`` values (the parameter dtype); ``moeckpt.trainer.train.DTYPES`` maps them to torch dtypes.
DTYPES = ("fp32", "bf16")
#: values of ``TrainConfig.resume_reads``.
RESUME_READS = ("auto", "exchange", "own")
#: ``--optimizer`` values: AdamW, or Muon for the hidden matrices and AdamW for the rest (``trainer/optimizers.py``).
OPTIMIZERS = ("adamw", "muon")
#: ``--muon-scheme`` values: where Muon's matrices meet (``trainer/muon_plan.py``).
MUON_SCHEMES = ("assign", "gather")
#: ``--data-dtype`` values.
DATA_DTYPES = ("auto", "uint16", "uint32", "bytes")
#: ``--backend`` values.
BACKENDS = ("gloo", "nccl")

_BIG = 10**9


def setting(
    default: Any,
    help: str,
    section: str,
    *,
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None,
    option: str | None = None,
    metavar: str | None = None,
    none_as: str | None = None,
    pattern: str | None = None,
    nonempty: bool = False,
    multiple: bool = False,
) -> Any:
    """A config field with what its option needs: help (one line), section, range (``min``..``max``, inclusive
    unless ``min_open``), choices (or a function giving them, asked each time: the backend registry), the option's
    spelling (default ``--field-name``), a word that stands for
    ``None`` (``ep``'s ``auto``), a regular expression a string must match, and whether it repeats."""
    if section not in SECTIONS:
        raise ValueError(f"section {section!r} is not one of {SECTIONS}")
    meta = {
        "help": help,
        "section": section,
        "min": min,
        "max": max,
        "min_open": min_open,
        "choices": choices,
        "option": option,
        "metavar": metavar,
        "none_as": none_as,
        "pattern": pattern,
        "nonempty": nonempty,
        "multiple": multiple,
    }
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


def required_setting(help: str, section: str, **kw: Any) -> Any:
    """:func:`setting` of a field without a default (the caller must give it)."""
    f = setting(None, help, section, **kw)
    f.default = MISSING
    return f


def choices_of(meta: Mapping) -> tuple[str, ...] | None:
    """A field's choices, asking the function that gives them where there is one."""
    choices = meta.get("choices")
    return choices() if callable(choices) else choices


def describe_range(meta: Mapping, kind: type) -> str:
    """``"an integer in 1..4096"``-style text of a field's accepted values."""
    noun = {int: "an integer", float: "a finite number"}.get(kind, "a value")
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f"{noun} {'>' if meta.get('min_open') else '>='} {lo:g} and <= {hi:g}"
    if lo is not None:
        return f"{noun} {'>' if meta.get('min_open') else '>='} {lo:g}"
    return noun


def check_value(name: str, value: Any, meta: Mapping, kind: type) -> str | None:
    """Why ``value`` is not acceptable for a field of type ``kind`` with metadata ``meta``; ``None`` if it is."""
    if kind is bool:
        return None if type(value) is bool else "must be true or false"
    if kind is int:
        if type(value) is not int:
            return f"must be {describe_range(meta, int)}"
    elif kind is float:
        if type(value) not in (int, float) or not math.isfinite(value):
            return f"must be {describe_range(meta, float)}"
    elif kind is str:
        if not isinstance(value, str):
            return "must be a string"
        allowed = choices_of(meta)
        if allowed and value not in allowed:
            return f"must be one of {', '.join(allowed)}"
        if meta.get("nonempty") and not value.strip():
            return "must not be empty"
        if meta.get("pattern") and not re.fullmatch(meta["pattern"], value):
            return f"is malformed (expected {meta.get('metavar') or meta['pattern']})"
        return None
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and (value <= lo if meta.get("min_open") else value < lo):
        return f"must be {describe_range(meta, kind)}"
    if hi is not None and value > hi:
        return f"must be {describe_range(meta, kind)}"
    return None


def check_settings(config: Any, *, may_be_empty: Collection[str] = ()) -> None:
    """Refuse, with a :class:`ValueError` naming the field, the first field of the config dataclass ``config``
    (fields made with :func:`setting`) whose value its type and metadata do not accept; ``None`` passes where the
    field is optional. ``may_be_empty``: string fields whose empty value the caller checks itself."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        kind, optional = field_kind(f, hints)
        if value is None and optional:
            continue
        values = value if f.metadata.get("multiple") else (value,)
        if f.metadata.get("multiple") and not isinstance(value, tuple):
            raise ValueError(f"{f.name}={value!r} must be a list of strings")
        if f.name in may_be_empty and value == "":
            continue
        for v in values:
            why = check_value(f.name, v, f.metadata, kind)
            if why is not None:
                raise ValueError(f"{f.name}={v!r} {why}")


def field_kind(f: Field, hints: dict[str, Any]) -> tuple[type, bool]:
    """``(base type, optional)`` of a config field: ``int | None`` is ``(int, True)``, ``tuple[str, ...]`` is
    ``(str, False)`` with ``multiple`` in its metadata."""
    hint = hints[f.name]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    if typing.get_origin(base) is tuple:
        base = typing.get_args(base)[0]
    return base, optional


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a training run needs; each field is one ``moeckpt train`` option (see :func:`setting`)."""

    # -- model ------------------------------------------------------------------------------------------------
    model: str = setting(
        "",
        "preset name (zaya-tiny, qwen3moe-tiny, ...) or a config.json  [required unless --init-from]",
        "model",
        metavar="PRESET|JSON",
    )
    init_from: str | None = setting(
        None,
        "start a new run from this checkpoint's weights and optimizer state (e.g. an import-hf output), "
        "resharded to the run's layout; the run starts at step 0; --model defaults to its model; ignored once "
        "--run-dir has a checkpoint",
        "model",
        metavar="CKPT",
        nonempty=True,
    )
    dtype: str = setting(
        "fp32", "parameter dtype (bf16 keeps fp32 master weights in the optimizer)", "model", choices=DTYPES
    )
    seed: int = setting(0, "seed of the initial weights and of the data order", "model", min=0, max=2**63 - 1)
    tp: int = setting(1, "tensor-parallel degree", "model", min=1, max=4096)
    ep: int | None = setting(
        1,
        "expert-parallel degree (divides dp = world / tp), or auto: the widest the model accepts in each world "
        "(for elastic runs that may shrink below it)",
        "model",
        min=1,
        max=4096,
        none_as="auto",
        metavar="N|auto",
    )
    cpu: bool = setting(False, "run on the CPU even when a GPU is visible", "model")
    backend: str | None = setting(
        None, "collective backend  [default: nccl on GPUs, gloo on the CPU]", "model", choices=BACKENDS
    )

    # -- data -------------------------------------------------------------------------------------------------
    data: str | None = setting(
        None,
        "token file: .bin (uint16) or .txt (bytes)  [default: the shipped demo text]",
        "data",
        metavar="PATH",
        nonempty=True,
    )
    data_dtype: str = setting("auto", "token dtype of --data (auto: from the extension)", "data", choices=DATA_DTYPES)
    seq_len: int = setting(64, "tokens per sample", "data", min=1, max=2**20)
    global_batch: int = setting(
        8, "samples per step over all data-parallel ranks (a multiple of dp)", "data", min=1, max=2**24
    )

    # -- optimizer --------------------------------------------------------------------------------------------
    steps: int = setting(
        100, "total optimizer steps of the run (a resumed run continues up to it)", "optimizer", min=1, max=_BIG
    )
    stop_at: int | None = setting(
        None, "stop this invocation after this step, saving first (0..--steps)", "optimizer", min=0, max=_BIG
    )
    lr: float = setting(3e-3, "peak learning rate", "optimizer", min=0, min_open=True, max=10)
    warmup_steps: int = setting(10, "linear warmup steps", "optimizer", min=0, max=_BIG)
    min_lr_ratio: float = setting(0.1, "the cosine decays to lr x this at the last step", "optimizer", min=0, max=1)
    weight_decay: float = setting(0.1, "AdamW decoupled weight decay (matrices only)", "optimizer", min=0, max=10)
    max_grad_norm: float = setting(1.0, "clip the global gradient norm to this (0: off)", "optimizer", min=0, max=1e9)
    log_every: int = setting(10, "print a progress line every N steps (0: none)", "optimizer", min=0, max=_BIG)
    optimizer: str = setting(
        "adamw",
        "adamw, or muon: Muon for the hidden weight matrices, AdamW for the rest, one learning rate (docs/trainer.md)",
        "optimizer",
        choices=OPTIMIZERS,
    )
    bias_update_rate: float = setting(
        1e-3,
        "DeepSeek-V3's routing correction bias moves this much per step towards balanced expert load "
        "(aux-loss-free balancing; 0: held fixed)",
        "optimizer",
        min=0,
        max=1,
    )
    muon_momentum: float = setting(0.95, "Muon's (Nesterov) momentum coefficient", "optimizer", min=0, max=0.9999)
    muon_ns_steps: int = setting(5, "Muon's Newton-Schulz iterations", "optimizer", min=1, max=100)
    muon_scheme: str = setting(
        "assign",
        "where Muon's matrices meet: assign (each whole matrix to one rank, "
        "balanced by size) or gather (every rank holding a part)",
        "optimizer",
        choices=MUON_SCHEMES,
    )

    # -- checkpointing ----------------------------------------------------------------------------------------
    run_dir: str = required_setting(
        "run directory (local path or s3://...): checkpoints and metrics.jsonl",
        "checkpointing",
        metavar="URL",
        nonempty=True,
    )
    save_every: int = setting(0, "checkpoint every K steps (0: only at the end)", "checkpointing", min=0, max=_BIG)
    format: str = setting("safetensors", "checkpoint format", "checkpointing", choices=backend_names)
    compress: str = setting(NONE, COMPRESS_HELP, "checkpointing", choices=compress_names)
    async_save: bool = setting(
        True,
        "persist checkpoints in a background thread (training blocks only for the host copy) or in the training thread",
        "checkpointing",
        option="--async-save/--sync-save",
    )
    keep_last: int = setting(3, "checkpoints kept in the run directory", "checkpointing", min=1, max=10**6)
    resume_reads: str = setting(
        "auto",
        "resuming, the ranks exchange replicated pieces over the process group (each stored byte read "
        "once), read their own, or auto: own on one host with a local checkpoint, else exchange",
        "checkpointing",
        choices=RESUME_READS,
    )
    reset_optimizer: bool = setting(
        False,
        "resuming from another optimizer's state: keep the weights and start this run's optimizer fresh (else refused)",
        "checkpointing",
    )
    memory_tier: bool = setting(
        False,
        "also commit checkpoints into host memory (a directory under /dev/shm per "
        "node and run) that outlives the workers; a restart resumes from it when it is at "
        "least as new as the newest persisted one (docs/fault-tolerance.md)",
        "checkpointing",
    )
    memory_every: int = setting(
        0,
        "with --memory-tier: a memory checkpoint every K steps (0: at every save); one "
        "due while the previous memory checkpoint is still being written is left out, counted and logged, "
        "and the interval doubles until the tier keeps up, then halves back to K",
        "checkpointing",
        min=0,
        max=_BIG,
        metavar="K",
    )
    memory_dir: str | None = setting(
        None,
        "with --memory-tier: the node-local parent directory of the memory "
        "checkpoints (the run's are in moeckpt-<run id> below it)  [default: /dev/shm]",
        "checkpointing",
        metavar="PATH",
        nonempty=True,
    )
    memory_keep: int = setting(
        2, "with --memory-tier: memory checkpoints kept per node", "checkpointing", min=1, max=1000
    )
    memory_replicas: int = setting(
        1,
        "with --memory-tier: copies of each node's part kept on other nodes (its buddies)",
        "checkpointing",
        min=0,
        max=64,
    )

    # -- faults -----------------------------------------------------------------------------------------------
    inject: tuple[str, ...] = setting(
        (),
        "inject a fault (repeatable): kill|hang|nan|kill-during-save|corrupt-file|slow:rank=R,step=S"
        "[,signal=TERM][,seconds=X][,world=W]",
        "faults",
        metavar="FAULT",
        multiple=True,
    )
    hang_timeout_s: float = setting(
        0.0,
        "end a worker whose step makes no progress for this many seconds, its "
        "stacks in RUN_DIR/hang-rank<R>.txt (0: off)",
        "faults",
        min=0,
        max=7 * 86400,
        option="--hang-timeout",
    )
    max_nan_rollbacks: int = setting(
        3,
        "NaN/Inf loss: roll back to the last checkpoint and skip the batches since, this many times",
        "faults",
        min=0,
        max=10**6,
    )
    max_restarts: int = setting(
        3,
        "restart the workers this many times after a worker fails or hangs (--nproc > "
        "1; with --nnodes every node loss or join is one too)",
        "faults",
        min=0,
        max=10**6,
    )

    # -- elastic ----------------------------------------------------------------------------------------------
    nproc: int = setting(1, "local worker processes (starts torchrun's agent when > 1)", "elastic", min=1, max=1024)
    nnodes: str | None = setting(
        None,
        "elastic run: this node is one of MIN..MAX nodes (torchrun elastic agent, c10d rendezvous)",
        "elastic",
        metavar="MIN:MAX",
        pattern=r"\d+(:\d+)?",
    )
    rdzv_endpoint: str | None = setting(
        None,
        "elastic run: the rendezvous, the same on every node; the node on HOST keeps its store",
        "elastic",
        metavar="HOST:PORT",
        pattern=r"[^:\s]+:\d{1,5}",
    )
    rdzv_id: str = setting(
        "moeckpt", "elastic run: the job's rendezvous id", "elastic", pattern=r"[A-Za-z0-9_.-]+", metavar="ID"
    )
    rdzv_conf: str = setting(
        "",
        "elastic run: torchrun --rdzv-conf, e.g. last_call_timeout=5",
        "elastic",
        pattern=r"([A-Za-z_]\w*=[^,=\s]+(,[A-Za-z_]\w*=[^,=\s]+)*)?",
        metavar="KEY=VALUE,...",
    )

    def __post_init__(self) -> None:
        check_settings(self, may_be_empty=("model",))  # an empty model is checked below, against init_from
        if not self.model and not self.init_from:
            raise ValueError("model is empty: name a preset or config.json, or give init_from to take its model")
        if not self.memory_tier:
            for name in ("memory_every", "memory_dir"):
                if getattr(self, name) not in (0, None):
                    raise ValueError(f"{name}={getattr(self, name)!r} needs memory_tier (--memory-tier)")
        if self.compress != NONE and self.compress not in backend_compressions(self.format):
            raise ValueError(
                f"compress={self.compress!r}: the {self.format} format stores bytes raw; train with --format zarr "
                "or --compress none"
            )
        if self.stop_at is not None and self.stop_at > self.steps:
            raise ValueError(f"stop_at={self.stop_at!r} must lie in [0, steps={self.steps}]")
        from .faults import parse_fault

        for spec in self.inject:
            parse_fault(spec)

    @classmethod
    def sections(cls) -> dict[str, list[Field]]:
        """The fields of each section, in declaration order."""
        out: dict[str, list[Field]] = {s: [] for s in SECTIONS}
        for f in fields(cls):
            out[f.metadata["section"]].append(f)
        return out

    @classmethod
    def option_name(cls, f: Field) -> str:
        """The option of field ``f`` as the user types it (the first spelling of a ``--a/--b`` pair)."""
        return (f.metadata.get("option") or "--" + f.name.replace("_", "-")).split("/")[0]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["inject"] = list(self.inject)
        return out

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"train config has unknown fields {sorted(unknown)}")
        value = dict(value)
        value["inject"] = tuple(value.get("inject", ()))  # JSON has lists
        return cls(**value)
