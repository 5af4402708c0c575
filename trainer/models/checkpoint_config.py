"""The config of a checkpoint-only family: the fields that shape its tensors, and the rest of its config.json.

The bundled trainer implements ZAYA1 and Qwen3-MoE, so their configs name every field the modules compute with.
The other families are converted and resharded (DeepSeek-V3 is also run: its module reads the constants it needs
from ``hf_config``, checked by ``deepseek_v3/runtime.py``): their plan needs only the fields that decide which
tensors exist and their shapes (:attr:`CheckpointConfig.SHAPE_FIELDS`, named as transformers names them), and
everything else in the ``config.json`` (RoPE scaling, routing constants, sliding windows, token ids) is kept
verbatim in ``hf_config`` and written back on export, so a round trip cannot drop an option the plan does not know.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from .base import MAX_DIM, check_fields, config_from_json, require_fields
from .hf_layout import hf_config_from, refuse_quantized


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Base of the checkpoint-only configs; subclasses add their shape fields (with transformers' defaults)."""

    #: every other config.json field, verbatim (JSON values).
    hf_config: dict[str, Any] = field(default_factory=dict)

    #: transformers' ``model_type`` and model class.
    MODEL_TYPE: ClassVar[str] = ""
    ARCHITECTURE: ClassVar[str] = ""
    #: shape fields a config.json must hold (the others default as transformers defaults them).
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    #: ranges of the integer fields that are not plain sizes (default 1..MAX_DIM).
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {}
    #: fields that are not config.json fields.
    NOT_HF: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.hf_config, dict):
            raise ValueError(f"hf_config={self.hf_config!r} must be a JSON object (the rest of the config.json)")
        try:
            json.dumps(self.hf_config, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"hf_config=... must hold JSON values only: {e}") from None
        for f in fields(self):  # JSON gives lists; a frozen config holds tuples (compared by value)
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        check_fields(self, {"num_hidden_layers": (1, 100_000), **self.BOUNDS})
        self.validate()

    def validate(self) -> None:
        """Family checks beyond each field's type and range (raise ``ValueError``)."""

    @classmethod
    def shape_fields(cls) -> tuple[str, ...]:
        """The fields written to config.json under their own names (all but ``hf_config`` and what a subclass
        keeps outside config.json)."""
        return tuple(f.name for f in fields(cls) if f.name not in ("hf_config", *cls.NOT_HF))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict):
        return config_from_json(cls, value)

    def to_hf(self, dtype: str) -> dict:
        """The ``config.json`` of this model: the kept fields, then the shape fields, then the export's dtype."""
        out: dict[str, Any] = {"architectures": [self.ARCHITECTURE]}
        out.update(self.hf_config)
        out["model_type"] = self.MODEL_TYPE
        out.update({k: _plain(getattr(self, k)) for k in self.shape_fields()})
        out["dtype"] = dtype
        return out

    @classmethod
    def from_hf(cls, doc: dict, **derived):
        """The config of a ``config.json``: its shape fields (``derived`` fills those transformers computes when
        absent, e.g. ``head_dim``), the rest kept verbatim; refuses quantized checkpoints."""
        refuse_quantized(doc, cls.MODEL_TYPE)
        require_fields(doc, cls.REQUIRED)
        names = cls.shape_fields()
        values = {k: doc[k] for k in names if k in doc}  # a null stays null (DeepSeek's q_lora_rank)
        for k, v in derived.items():
            if values.get(k) is None:
                values[k] = v
        return cls(**values, hf_config=hf_config_from(doc, names))


@dataclass(frozen=True, kw_only=True)
class CarriesMtp(CheckpointConfig):
    """A config whose checkpoints may hold multi-token-prediction layers past ``num_hidden_layers`` (DeepSeek-V3's
    ``model.layers.61.*``, GLM-4.5's ``model.layers.46.*``): the model transformers builds has none (it ignores
    them on load), but they are trained weights of the checkpoint, so they are carried through.

    ``mtp_tensors`` maps each such tensor to its shape, taken from the imported files (:meth:`with_tensors`);
    the plan holds them replicated (no split, which is correct for any tensor) and export writes them back.
    """

    NOT_HF = ("mtp_tensors",)
    if TYPE_CHECKING:  # every subclass's shape field (declared there, with its default)
        num_hidden_layers: int

    mtp_tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        ok = isinstance(self.mtp_tensors, dict)
        for name, shape in self.mtp_tensors.items() if ok else ():
            layer = _layer_of(name)
            ok = ok and layer is not None and layer >= self.num_hidden_layers
            ok = ok and isinstance(shape, (list, tuple)) and all(type(s) is int and 0 <= s <= MAX_DIM for s in shape)
        if not ok:
            raise ValueError(
                f"mtp_tensors={self.mtp_tensors!r} must map tensors of layers past num_hidden_layers to their shapes"
            )
        object.__setattr__(self, "mtp_tensors", {n: tuple(s) for n, s in sorted(self.mtp_tensors.items())})

    def with_tensors(self, shapes: dict[str, tuple[int, ...]]):
        """This config with the MTP tensors among ``shapes`` (an HF directory's tensors) recorded."""
        mtp = {n: tuple(s) for n, s in shapes.items() if (_layer_of(n) or 0) >= self.num_hidden_layers}
        return dataclasses.replace(self, mtp_tensors=mtp)

    def to_json(self) -> dict:
        out = super().to_json()
        out["mtp_tensors"] = {n: list(s) for n, s in self.mtp_tensors.items()}
        return out


def _layer_of(name: str) -> int | None:
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def check_divides(tp: int, ep: int, *, tp_fields: dict[str, int], ep_fields: dict[str, int], why: str = "") -> None:
    """Refuse a (tp, ep) that does not divide the named fields, naming the first that it does not."""
    from moeckpt.formats.errors import LayoutError

    for name, value in tp_fields.items():
        if value % tp:
            raise LayoutError(f"tp={tp} must divide {name}={value}{why}")
    for name, value in ep_fields.items():
        if value % ep:
            raise LayoutError(f"ep={ep} must divide {name}={value}")


def generation_config(cfg: CheckpointConfig) -> dict:
    """``generation_config.json``: the token ids the model's config.json names (none for a vocabulary without)."""
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: cfg.hf_config[k] for k in ids if cfg.hf_config.get(k) is not None}
