"""Option types that refuse every hostile value with one line naming the option: numbers in a range (never NaN,
infinite or absurdly large), non-empty and well-formed strings."""

from __future__ import annotations

import math
import re

import click

__all__ = ["Number", "Text", "count", "number"]


class Number(click.ParamType):
    """An integer or finite float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); ``none_as`` spells ``None``."""

    def __init__(
        self,
        kind: type = int,
        lo: float | None = None,
        hi: float | None = None,
        *,
        lo_open: bool = False,
        none_as: str | None = None,
    ) -> None:
        self.kind, self.lo, self.hi, self.lo_open, self.none_as = kind, lo, hi, lo_open, none_as
        self.name = ("N" if kind is int else "X") + (f"|{none_as}" if none_as else "")

    def describe(self) -> str:
        noun = "an integer" if self.kind is int else "a finite number"
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
        if self.hi is not None:
            parts.append(f"<= {self.hi:g}")
        text = f"{noun} {' and '.join(parts)}".strip()
        return f"{text}, or {self.none_as}" if self.none_as else text

    def convert(self, value, param, ctx):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            self.fail(f"{value!r} is not {self.describe()}", param, ctx)
        if isinstance(value, str):
            text = value.strip()
            if self.none_as is not None and text == self.none_as:
                return None
            try:
                number = int(text) if self.kind is int else float(text)
            except ValueError:
                self.fail(f"{value!r} is not {self.describe()}", param, ctx)
        else:
            number = value
        if self.kind is int and (not isinstance(number, int) or isinstance(number, bool)):
            self.fail(f"{value!r} is not {self.describe()}", param, ctx)
        if self.kind is float:
            number = float(number)
            if not math.isfinite(number):
                self.fail(f"{value!r} is not {self.describe()}", param, ctx)
        low_bad = self.lo is not None and (number <= self.lo if self.lo_open else number < self.lo)
        if low_bad or (self.hi is not None and number > self.hi):
            self.fail(f"{value!r} is out of range: expected {self.describe()}", param, ctx)
        return number


def count(lo: int = 1, hi: int = 10**9) -> Number:
    """An integer option in ``[lo, hi]``."""
    return Number(int, lo, hi)


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Number:
    """A finite float option in ``[lo, hi]``."""
    return Number(float, lo, hi, lo_open=lo_open)


class Text(click.ParamType):
    """A string that is not empty (nor only blanks) and, with ``pattern``, matches it whole."""

    name = "TEXT"

    def __init__(self, pattern: str | None = None, *, expect: str | None = None, allow_empty: bool = False) -> None:
        self.pattern = pattern
        self.expect = expect or pattern
        self.allow_empty = allow_empty

    def convert(self, value, param, ctx):
        if value is None:
            return None
        text = str(value)
        if not text.strip():
            if self.allow_empty and text == "":
                return text
            self.fail("must not be empty", param, ctx)
        if self.pattern and not re.fullmatch(self.pattern, text):
            self.fail(f"{text!r} is malformed: expected {self.expect}", param, ctx)
        return text
