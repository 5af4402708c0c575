"""What ``moeckpt eval`` evaluates and on which samples: :class:`EvalConfig`, whose fields the command's options
are made from (as ``moeckpt train``'s from ``TrainConfig``). Kept apart from the evaluation itself, so that the
CLI builds its options without importing the model code."""

from __future__ import annotations

from dataclasses import dataclass

from .config import DATA_DTYPES, check_settings, required_setting, setting
from .data import default_text_path

__all__ = ["EvalConfig"]


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """What to evaluate and on which samples; the ``moeckpt eval`` options map one-to-one onto these fields, each
    made with :func:`~moeckpt.trainer.config.setting` (help, range, choices) and checked as ``TrainConfig``'s are
    (a :class:`ValueError` naming the field)."""

    checkpoint: str = required_setting(
        "a checkpoint directory, or a run directory (its newest committed step); local path or URL", "checkpointing"
    )
    data: str | None = setting(
        None,
        "token file: .bin (uint16) or .txt (bytes); default: the shipped demo text, as moeckpt train",
        "data",
        metavar="PATH",
        nonempty=True,
    )
    data_dtype: str = setting("auto", "token dtype of --data (auto: from the extension)", "data", choices=DATA_DTYPES)
    tp: int = setting(1, "tensor-parallel degree of the evaluation (any; resharded at load)", "model", min=1, max=4096)
    ep: int = setting(1, "expert-parallel degree of the evaluation (divides nproc / tp)", "model", min=1, max=4096)
    seq_len: int | None = setting(
        None, "tokens per sample; default: the checkpoint's training seq_len (else 64)", "data", min=1, max=2**20
    )
    batch_size: int | None = setting(
        None,
        "samples per batch over all ranks; default: the checkpoint's global batch (else 8)",
        "data",
        min=1,
        max=2**24,
    )
    batches: int = setting(
        4, "batches to average over (together at most the samples in --data)", "data", min=1, max=10**9
    )
    start_sample: int = setting(
        0, "first global sample (in file order the batches must end within the data)", "data", min=0, max=2**62
    )
    shuffle: bool = setting(
        False, "read samples in the trainer's shuffled order (with --seed), epochs included", "data"
    )
    seed: int | None = setting(
        None,
        "seed of the shuffled order; default: the checkpoint's training seed (else 0)",
        "data",
        min=0,
        max=2**63 - 1,
    )
    cpu: bool = setting(False, "run on the CPU even when a GPU is visible", "model")

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def data_path(self) -> str:
        return self.data or default_text_path()
