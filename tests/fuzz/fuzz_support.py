"""Shared pieces of the fuzz properties: example counting (for ``bench/fuzz.py``) and the
strategies that build hostile inputs, raw and structure-aware."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from hypothesis import strategies as st

P = ParamSpec("P")
R = TypeVar("R")

# test function name → examples it ran (shrinking replays included); conftest reports it.
COUNTS: Counter[str] = Counter()


def counted(fn: Callable[P, R]) -> Callable[P, R]:
    """Count every example a property runs; goes directly under ``@given``."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        COUNTS[fn.__name__] += 1
        return fn(*args, **kwargs)

    return wrapper


def one_line(message: str) -> bool:
    return bool(message) and "\n" not in message and "\r" not in message


def listing(path: Path) -> set[str]:
    """Every path under ``path``, relative: what a property checks stays unchanged."""
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def cwd_listing() -> set[str]:
    return set(os.listdir())  # noqa: PTH208 (a cheap top-level snapshot)


# -- leaves -------------------------------------------------------------------------------

HUGE_INTS = [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, -(10**30)]
ODD_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 0.0]


def long_text() -> st.SearchStrategy[str]:
    """Strings from empty to very long (100 kB), with control characters and newlines."""
    return st.one_of(
        st.text(max_size=40),
        st.sampled_from(["", "\n", "a\nb", "\x00", "`", "$", "\ufffd", "é" * 3]),
        st.integers(1000, 100_000).map(lambda n: "x" * n),
    )


def ints() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-5, 5), st.integers(), st.sampled_from(HUGE_INTS))


def floats() -> st.SearchStrategy[float]:
    return st.one_of(st.floats(), st.sampled_from(ODD_FLOATS))


def scalars() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), ints(), floats(), long_text())


def json_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )


def deep(depth: int, kind: str = "list") -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def deep_json() -> st.SearchStrategy[bytes]:
    """Nesting deep enough to exhaust a recursive parser (bytes, not built objects)."""
    return st.builds(
        lambda n, ch: (ch[0] * n + ch[1] * n).encode(),
        st.sampled_from([10, 100, 1000, 5000, 100_000]),
        st.sampled_from(["[]", "{}"]).map(lambda s: (s[0] if s == "[]" else '{"a":', s[1])),
    )


# -- structure-aware mutation -------------------------------------------------------------


def _slots(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every (container path, key) in a JSON-like document."""
    found: list[tuple[Any, ...]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            found.append((*path, key))
            found += _slots(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found.append((*path, i))
            found += _slots(value, (*path, i))
    return found


def _dicts(doc: Any) -> list[dict[Any, Any]]:
    if isinstance(doc, dict):
        return [doc] + [d for v in doc.values() for d in _dicts(v)]
    if isinstance(doc, list):
        return [d for v in doc for d in _dicts(v)]
    return []


def _parent(doc: Any, slot: tuple[Any, ...]) -> Any:
    node = doc
    for key in slot[:-1]:
        node = node[key]
    return node


_KEY = st.text(max_size=12)
_ADDED = json_values(4)
_REPLACEMENT = json_values(6)
_TAG_JUNK = st.one_of(long_text(), json_values(2))
_OPS = st.sampled_from(["replace", "delete", "add", "tag", "deep"])
_PICK = st.integers(0, 2**16)
_DEEP = st.tuples(st.sampled_from([50, 300]), st.sampled_from(["list", "dict"]))


def _pick(draw: st.DrawFn, items: list[Any]) -> Any:
    return items[draw(_PICK) % len(items)]


@st.composite
def mutated(draw: st.DrawFn, base: Any, tags: tuple[str, ...] = ()) -> Any:
    """``base`` (a valid document) with a few edits: a value replaced by anything (wrong
    type, huge number, NaN, long string, deep nesting), a key removed, an unknown key
    added, a tag changed to another real one or to garbage."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 4))):
        slots = _slots(doc)
        op = draw(_OPS)
        if op == "add" or not slots:
            tables = _dicts(doc)
            if tables:
                _pick(draw, tables)[draw(_KEY)] = draw(_ADDED)
            continue
        slot = _pick(draw, slots)
        parent, key = _parent(doc, slot), slot[-1]
        if op == "replace":
            parent[key] = draw(_REPLACEMENT)
        elif op == "delete":
            del parent[key]
        elif op == "deep":  # last: walking it again would exhaust the test's own stack
            parent[key] = deep(*draw(_DEEP))
            break
        elif op == "tag" and isinstance(doc, dict):
            for name in ("kind", "command", "type", "action"):
                if name in doc:
                    real = draw(st.booleans()) and bool(tags)
                    doc[name] = _pick(draw, list(tags)) if real else draw(_TAG_JUNK)
    return doc


def to_json(doc: Any) -> bytes:
    """JSON text of ``doc`` as a sloppy writer would send it: NaN and Infinity tokens, and
    very deep nesting, are allowed through."""
    try:
        return json.dumps(doc, allow_nan=True).encode("utf-8", errors="surrogatepass")
    except (RecursionError, ValueError):
        return b"[" * 3000 + b"]" * 3000


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """Bytes of a document, sometimes truncated or with a non-UTF-8 byte spliced in."""
    op = draw(st.sampled_from(["keep", "keep", "truncate", "splice"]))
    if op == "truncate" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if op == "splice":
        at = draw(st.integers(0, len(data)))
        junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xfe\xff"]))
        return data[:at] + junk + data[at:]
    return data


def structured(base: Any, tags: tuple[str, ...] = ()) -> st.SearchStrategy[bytes]:
    """Valid-shaped JSON documents that are wrong in one or a few places."""
    return mutated(base, tags).map(to_json).flatmap(damaged)


def raw_or_structured(base: Any, tags: tuple[str, ...] = ()) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=300), deep_json(), structured(base, tags))
