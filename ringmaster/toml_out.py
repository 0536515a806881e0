"""Writing the small TOML files the agents read (their settings): msgspec reads TOML but
writes it only with tomli_w, and these files need no more than this. Shared by the
simulator and ``coordinatorctl join``, which writes a real agent's settings."""

from __future__ import annotations

import json
from typing import Any


def to_toml(data: dict[str, Any]) -> str:
    """Top-level keys, then one table per section; values are strings, numbers, booleans
    and lists of those (msgspec reads TOML but writes it only with tomli_w)."""
    lines = [f"{k} = {_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]", *(f"{k} = {_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
