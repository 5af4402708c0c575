"""How a value read from a foreign or damaged file is shown in a message: its type and a short prefix, never all
of it.

``repr`` of a value a file built walks all of it: a 999-byte pickle can hold a list that expands to 10**9 strings
through memo references, and a 5,000-digit integer cannot be formatted at all. :func:`bounded_repr` renders at
most ``limit`` characters and looks at no more elements than it shows, so its cost does not depend on the value.
Every message of the format layer that quotes such a value goes through it.
"""

from __future__ import annotations

#: characters a rendering shows by default (a path or a tensor name fits; a bomb shows its first level).
DEFAULT_LIMIT = 120
#: integers wider than this many bits are shown by their width only (their digits could not be formatted).
_WIDE_INT_BITS = 256


def bounded_repr(value: object, limit: int = DEFAULT_LIMIT) -> str:
    """At most about ``limit`` characters saying what ``value`` is: ``repr`` for short scalars and strings, the type
    and length with a prefix for long strings and containers, the type name for anything else (no ``__repr__`` of
    the value's class is ever called)."""
    limit = max(16, limit)
    out: list[str] = []
    _render(value, out, [limit], 0)
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _render(value: object, out: list[str], budget: list[int], depth: int) -> None:
    if budget[0] <= 0:
        out.append("...")
        return
    text: str
    if value is None or type(value) is bool:
        text = repr(value)
    elif isinstance(value, float):
        text = float.__repr__(value)
    elif isinstance(value, int):
        n = int.bit_length(value)
        text = f"an int of {n} bits" if n > _WIDE_INT_BITS else int.__repr__(value)
    elif isinstance(value, (str, bytes, bytearray)):
        text = _text(value, budget[0])
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        _container(value, out, budget, depth)
        return
    else:
        text = f"<{type(value).__name__}>"
    out.append(text)
    budget[0] -= len(text)


def _text(value: str | bytes | bytearray, room: int) -> str:
    shown = value[: max(8, room)]
    body = str.__repr__(shown) if isinstance(shown, str) else repr(bytes(shown))
    if len(shown) == len(value):
        return body
    return f"{type(value).__name__} of length {len(value)}: {body}..."


_BRACKETS: dict[type, tuple[str, str]] = {
    list: ("[", "]"),
    tuple: ("(", ")"),
    dict: ("{", "}"),
    set: ("{", "}"),
    frozenset: ("{", "}"),
}


def _container(value: list | tuple | dict | set | frozenset, out: list[str], budget: list[int], depth: int) -> None:
    kind = next(k for k in _BRACKETS if isinstance(value, k))
    n = len(value)
    if depth == 0 and n > 4:
        head = f"{type(value).__name__} of {n} items: "
        out.append(head)
        budget[0] -= len(head)
    open_, close = _BRACKETS[kind]
    out.append(open_)
    budget[0] -= 2
    if depth >= 4:
        out.append("...")
    else:
        items = iter(value.items()) if isinstance(value, dict) else iter(value)
        for i, item in enumerate(items):
            if i:
                out.append(", ")
                budget[0] -= 2
            if budget[0] <= 0:
                out.append("...")
                break
            if isinstance(value, dict):
                key, item = item
                _render(key, out, budget, depth + 1)
                out.append(": ")
                budget[0] -= 2
            _render(item, out, budget, depth + 1)
    out.append(close)


def bounded_text(text: str, limit: int = DEFAULT_LIMIT) -> str:
    """A name from a foreign file shown as it is (no quotes) when it is short, else its first characters and its
    length."""
    if not isinstance(text, str):
        return bounded_repr(text, limit)
    if len(text) <= limit:
        return text
    return f"{text[: max(16, limit - 24)]}... ({len(text)} chars)"
