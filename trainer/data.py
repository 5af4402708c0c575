"""Training data: memory-mapped token files cut into fixed-length samples, read in a resumable global order.

Inputs are what Megatron and nanoGPT users already have: a flat file of little-endian ``uint16`` or ``uint32`` token
ids (nanoGPT's ``train.bin``), or, for the tiny presets, any text file read as bytes (vocabulary 256). Sample ``i``
is the ``seq_len + 1`` tokens starting at ``i * seq_len``: inputs are its first ``seq_len`` tokens, targets the last.

The position is one global sample counter, independent of the data-parallel degree. Optimizer step ``k`` consumes
the global samples ``k*B .. k*B + B - 1`` (``B`` the global batch), data-parallel rank ``r`` of ``dp`` taking the
``r``-th run of ``B / dp`` of them; global sample ``g`` is dataset sample ``perm_e[g mod N]`` in epoch
``e = g // N``, where ``perm_e`` is a permutation derived from ``(seed, e)`` only. So after ``k`` steps the next
sample is ``k * B`` whatever ``dp`` was, and a run resumed on another number of ranks reads exactly the samples the
uninterrupted run would have read.
"""

from __future__ import annotations

import os
import random
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moeckpt.formats.errors import MoeckptError

__all__ = [
    "BatchLoader",
    "DataError",
    "TOKEN_DTYPES",
    "TokenDataset",
    "default_text_path",
    "make_text",
    "permutation",
    "write_tokens",
]

#: on-disk token formats: raw little-endian integers, or raw bytes of a text (vocabulary 256).
TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4"), "bytes": np.dtype("u1")}

_MASK = (1 << 64) - 1


class DataError(MoeckptError, ValueError):
    """A data file that cannot be read as tokens, or a data position that does not fit the data or the layout."""


def _resolve_dtype(path: str, dtype: str) -> str:
    if dtype != "auto":
        if dtype not in TOKEN_DTYPES:
            raise DataError(f"{path}: unknown token dtype {dtype!r}; --data-dtype takes {', '.join(TOKEN_DTYPES)}")
        return dtype
    suffix = Path(path).suffix.lower()
    if suffix == ".txt":
        return "bytes"
    if suffix == ".bin":
        return "uint16"  # nanoGPT's convention for GPT-2 tokens
    raise DataError(
        f"{path}: cannot tell the token format from the extension {suffix or '(none)'!r}; "
        f"name it .txt (bytes) or .bin (uint16), or pass --data-dtype {'|'.join(TOKEN_DTYPES)}"
    )


class TokenDataset:
    """Fixed-length samples of a memory-mapped token file; sample ``i`` is ``tokens[i*L : i*L + L + 1]``."""

    def __init__(self, path: str | os.PathLike, *, seq_len: int, dtype: str = "auto", vocab_size: int | None = None):
        self.path = os.fspath(path)
        self.dtype = _resolve_dtype(self.path, dtype)
        self.seq_len = seq_len
        #: ids at or above this are refused with a :class:`DataError` when a sample is read.
        self.vocab_size = vocab_size
        if type(seq_len) is not int or seq_len < 1:
            raise DataError(f"{self.path}: seq_len must be a positive integer, got {seq_len!r}")
        if self.dtype == "bytes" and vocab_size is not None and vocab_size < 256:
            raise DataError(f"{self.path}: a byte-level text needs vocab_size >= 256, the model has {vocab_size}")
        np_dtype = TOKEN_DTYPES[self.dtype]
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise DataError(f"{self.path}: cannot read the data file ({e.strerror or e}); check --data") from None
        if size % np_dtype.itemsize:
            raise DataError(
                f"{self.path}: size {size} bytes is not a multiple of {np_dtype.itemsize}, so it is not a "
                f"{self.dtype} token file; pass the dtype it was written with (--data-dtype)"
            )
        self.num_tokens = size // np_dtype.itemsize
        if self.num_tokens < seq_len + 1:
            raise DataError(
                f"{self.path}: {self.num_tokens} tokens are fewer than one sample of seq_len + 1 = {seq_len + 1}; "
                "use more data or a shorter sequence"
            )
        self._tokens = np.memmap(self.path, dtype=np_dtype, mode="r")

    def __len__(self) -> int:
        """Number of samples: every token but the very last starts a target."""
        return (self.num_tokens - 1) // self.seq_len

    def get(self, indices: Sequence[int]) -> torch.Tensor:
        """Samples ``indices`` as an ``int64`` tensor of shape ``[len(indices), seq_len + 1]``."""
        n, length = len(self), self.seq_len + 1
        out = np.empty((len(indices), length), dtype=np.int64)
        for row, i in enumerate(indices):
            if not 0 <= i < n:
                raise DataError(f"{self.path}: sample {i} is outside the {n} samples of seq_len {self.seq_len}")
            out[row] = self._tokens[i * self.seq_len : i * self.seq_len + length]
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            row = int(np.nonzero(out.max(axis=1) >= self.vocab_size)[0][0])
            raise DataError(
                f"{self.path}: sample {indices[row]} holds token id {int(out[row].max())} >= the model's "
                f"vocab_size {self.vocab_size}; the data was tokenized for another vocabulary"
            )
        return torch.from_numpy(out)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijection of uint64 with good mixing, identical on every platform and version."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of ``epoch``: a permutation of ``range(n)`` that depends on ``(seed, epoch)`` only.

    Sorting distinct hash keys (SplitMix64 is a bijection) needs no random number generator whose stream could
    change between library versions, so a checkpoint resumes to the same order on any machine.
    """
    base = _splitmix64(np.array([seed & _MASK], dtype=np.uint64))[0]
    base = _splitmix64(np.array([int(base) ^ (epoch & _MASK)], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        keys = _splitmix64(np.arange(n, dtype=np.uint64) + base)
    return np.argsort(keys, kind="stable")


class BatchLoader:
    """This data-parallel rank's share of each global batch, at a resumable global sample position.

    ``global_batch`` samples make one optimizer step across all ``dp`` ranks; this rank reads the
    ``dp_rank``-th run of ``global_batch / dp``. With ``shuffle=False`` samples are read in file order.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        global_batch: int,
        dp_rank: int = 0,
        dp: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if type(global_batch) is not int or global_batch < 1:
            raise DataError(f"global_batch must be a positive integer, got {global_batch!r}")
        if type(dp) is not int or dp < 1 or not 0 <= dp_rank < dp:
            raise DataError(f"dp_rank={dp_rank!r} must lie in [0, dp) with dp={dp!r} a positive integer")
        if global_batch % dp:
            raise DataError(
                f"global_batch={global_batch} is not divisible by dp={dp}: every data-parallel rank must read "
                "the same number of samples; pick a global batch that is a multiple of dp"
            )
        self.dataset = dataset
        self.global_batch = global_batch
        self.dp_rank, self.dp = dp_rank, dp
        self.seed = seed
        self.shuffle = shuffle
        #: global samples consumed so far by all ranks together (the position; a multiple of nothing in particular).
        self.consumed_samples = 0
        self._perm: tuple[int, np.ndarray] | None = None

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp

    def epoch_of(self, sample: int) -> int:
        return sample // len(self.dataset)

    def dataset_index(self, sample: int) -> int:
        """The dataset sample that global sample ``sample`` reads."""
        n = len(self.dataset)
        epoch, offset = divmod(sample, n)
        if not self.shuffle:
            return offset
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, permutation(n, self.seed, epoch))
        return int(self._perm[1][offset])

    def local_samples(self, start: int | None = None) -> list[int]:
        """The global sample numbers this rank reads for the step that starts at ``start`` (default: now)."""
        start = self.consumed_samples if start is None else start
        first = start + self.dp_rank * self.local_batch
        return list(range(first, first + self.local_batch))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(inputs, targets)`` of the next step, each ``[global_batch / dp, seq_len]`` int64.

        Advances the position by the whole global batch (what every rank together consumed).
        """
        samples = self.dataset.get([self.dataset_index(g) for g in self.local_samples()])
        self.consumed_samples += self.global_batch
        return samples[:, :-1].contiguous(), samples[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """The position as plain JSON; the same on every rank, independent of dp."""
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "seq_len": self.dataset.seq_len,
            "num_samples": len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position; the order (seed, shuffle) and the sample geometry must be the same.

        The global batch and dp may differ: the position counts samples, not steps or ranks.
        """
        if not isinstance(state, Mapping):
            raise DataError(f"data state must be a JSON object, got {type(state).__name__}")
        consumed = state.get("consumed_samples")
        if type(consumed) is not int or consumed < 0:
            raise DataError(f"data state: 'consumed_samples' must be a non-negative integer, got {consumed!r}")
        mine = self.state_dict()
        for key in ("seed", "shuffle", "seq_len", "num_samples"):
            if key in state and state[key] != mine[key]:
                raise DataError(
                    f"data state: saved {key}={state[key]!r} but this run has {key}={mine[key]!r} "
                    f"({self.dataset.path}); resuming would read other samples. Use the run's original data "
                    "and settings, or start a new run"
                )
        self.consumed_samples = consumed


def write_tokens(path: str | os.PathLike, tokens: Sequence[int] | np.ndarray, dtype: str = "uint16") -> None:
    """Write token ids as a raw little-endian file that :class:`TokenDataset` reads (nanoGPT's ``.bin``)."""
    np_dtype = TOKEN_DTYPES[dtype]
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np_dtype).max):
        raise DataError(f"{os.fspath(path)}: token ids out of range for {dtype}")
    arr.astype(np_dtype).tofile(os.fspath(path))


# --------------------------------------------------------------------------------------------- demo text

_NAMES = ["Anna", "Tomas", "Ilse", "Marek", "Lena", "Oskar", "Greta", "Pavel", "Nora", "Emil"]
_NOUNS = [
    "miller",
    "fox",
    "river",
    "lantern",
    "garden",
    "bridge",
    "raven",
    "orchard",
    "shepherd",
    "kettle",
    "mountain",
    "village",
    "baker",
    "wolf",
    "meadow",
    "tower",
    "fisherman",
    "ship",
    "forest",
    "weaver",
    "goose",
    "bell",
    "road",
    "cellar",
    "window",
    "queen",
    "soldier",
    "clock",
    "harbour",
    "candle",
]
_ADJECTIVES = [
    "old",
    "grey",
    "quiet",
    "bright",
    "small",
    "cold",
    "golden",
    "crooked",
    "patient",
    "tired",
    "green",
    "clever",
    "heavy",
    "distant",
    "gentle",
    "proud",
    "narrow",
    "silver",
]
_INTRANSITIVE = ["slept", "waited", "laughed", "wandered", "sang", "listened", "rested", "trembled", "vanished"]
_TRANSITIVE = [
    "watched",
    "found",
    "carried",
    "followed",
    "mended",
    "remembered",
    "painted",
    "called",
    "fed",
    "guarded",
    "opened",
    "praised",
]
_PREPOSITIONS = ["near", "beyond", "under", "beside", "behind", "across", "above", "inside"]
_TIMES = ["at dawn", "in the evening", "before the rain", "all winter", "after supper", "at midnight", "in spring"]
_SAYINGS = [
    "A slow road still reaches the mill",
    "Nobody counts the geese before the frost",
    "The river keeps what the bridge forgets",
    "Every lantern was once a candle",
    "Bread shared is bread doubled",
    "The wolf is only loud at the edge of the forest",
]


def _noun_phrase(rng: random.Random) -> str:
    if rng.random() < 0.25:
        return rng.choice(_NAMES)
    det = rng.choice(["the", "the", "a", "every", "that"])
    adj = rng.choice(_ADJECTIVES) + " " if rng.random() < 0.55 else ""
    return f"{det} {adj}{rng.choice(_NOUNS)}"


def _clause(rng: random.Random) -> str:
    subject = _noun_phrase(rng)
    if rng.random() < 0.35:
        verb = rng.choice(_INTRANSITIVE)
    else:
        verb = f"{rng.choice(_TRANSITIVE)} {_noun_phrase(rng)}"
    tail = ""
    r = rng.random()
    if r < 0.35:
        tail = f" {rng.choice(_PREPOSITIONS)} the {rng.choice(_NOUNS)}"
    elif r < 0.55:
        tail = " " + rng.choice(_TIMES)
    return f"{subject} {verb}{tail}"


def _sentence(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.12:
        return f'"{rng.choice(_SAYINGS)}," said {rng.choice(_NAMES)}.'
    if r < 0.3:
        return f"When {_clause(rng)}, {_clause(rng)}."
    if r < 0.5:
        text = f"{_clause(rng)}, and {_clause(rng)}."
    else:
        text = f"{_clause(rng)}."
    return text[0].upper() + text[1:]


def make_text(nbytes: int, seed: int = 0) -> str:
    """Deterministic pseudo-English prose of exactly ``nbytes`` ASCII bytes (the shipped demo corpus).

    Short fables from a small grammar: enough structure (words, agreement-free clauses, punctuation, quotes,
    paragraphs) for a byte-level model's loss to fall visibly within a few hundred CPU steps. ``random.Random``
    with an integer seed produces the same stream on every Python 3 version, so the output is reproducible.
    """
    rng = random.Random(seed)
    chapters: list[str] = []
    size = 0
    chapter = 0
    while size < nbytes:
        chapter += 1
        paragraphs = [f"Chapter {chapter}. The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"]
        for _ in range(rng.randint(3, 7)):
            body = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7)))
            paragraphs.append(textwrap.fill(body, width=72))
        block = "\n\n".join(paragraphs) + "\n\n\n"
        chapters.append(block)
        size += len(block)
    return "".join(chapters)[:nbytes]


#: name and size of the shipped corpus, in the package's ``data/`` folder.
DEMO_TEXT = "fables.txt"
DEMO_TEXT_BYTES = 400_000


def default_text_path() -> str:
    """The shipped byte-level demo corpus (``make_text(DEMO_TEXT_BYTES, seed=0)``, public domain)."""
    return str(Path(__file__).with_name("data") / DEMO_TEXT)
