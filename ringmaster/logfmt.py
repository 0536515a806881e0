"""logfmt lines (``key=value key="a value with spaces"``): one writer, one reader.

The writer is structlog's ``LogfmtRenderer`` (the daemons already log through structlog);
:func:`parse_line` reads back exactly what it writes, so every reader of the ranks' logs
(tests, the ledger check, the benches) sees a quoted value whole instead of cutting it at
its first space. What the renderer writes: a value holding a space, ``=`` or ``"`` is
quoted, and inside the quotes a backslash is doubled and ``"`` escaped; a newline is
written ``\\n`` everywhere; a ``True`` is the bare key (a flag).

One ambiguity is the renderer's own: outside quotes it leaves a backslash as is, so a
bare ``a\\nb`` may have been a newline or a backslash and an ``n``; it is read as written.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from structlog.processors import LogfmtRenderer

_RENDERER = LogfmtRenderer()

# key, then either ="quoted" (its closing quote may be missing: a process killed mid-line),
# =bare, or nothing (a flag)
_PAIR = re.compile(r'([^ =]+)(?:=(?:"((?:[^"\\]|\\.)*)(?:"|$)|([^ ]*)))?')
_ESCAPE = re.compile(r"\\(.)")
_ESCAPED = {"n": "\n", '"': '"', "\\": "\\"}


def render(fields: Mapping[str, object]) -> str:
    """One line, keys in ``fields``' order."""
    return _RENDERER(None, "", dict(fields))


def parse_line(text: str) -> dict[str, str]:
    """Every ``key=value`` of one line (a flag reads ``"true"``); a repeated key keeps
    its last value. Never raises: a torn line yields what it holds."""
    out: dict[str, str] = {}
    for m in _PAIR.finditer(text.rstrip("\n")):
        key, quoted, bare = m.groups()
        if quoted is not None:
            out[key] = _ESCAPE.sub(lambda e: _ESCAPED.get(e[1], e[0]), quoted)
        else:
            out[key] = "true" if bare is None else bare
    return out


def lines(text: str) -> Iterator[dict[str, str]]:
    """:func:`parse_line` of every line of a log (split at ``\\n`` only: a value may hold
    any other line break the renderer leaves as is)."""
    return (parse_line(line) for line in text.split("\n") if line)
