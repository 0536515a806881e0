"""Reading a job file: TOML → ``--set`` overrides → :class:`proto.job.JobSpec`, with every
error one line that names the key, the value and what was expected."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect

from proto.job import JobSpec


class JobFileError(ValueError):
    pass


def load_job(path: Path, overrides: list[str]) -> JobSpec:
    try:
        raw = msgspec.toml.decode(path.read_bytes())
    except FileNotFoundError:
        raise JobFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise JobFileError(f"{path}: is a directory, not a job file") from None
    except PermissionError:
        raise JobFileError(f"{path}: permission denied") from None
    except msgspec.DecodeError as exc:
        raise JobFileError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise JobFileError(f"{path}: not valid TOML: not UTF-8 at byte {exc.start}") from None
    except OSError as exc:  # not a directory, name too long, ...
        raise JobFileError(f"{path}: {exc.strerror or type(exc).__name__}") from None
    for item in overrides:
        apply_override(raw, item)
    spec = to_spec(raw, str(path))
    anchor_paths(spec, path.resolve().parent)
    return spec


def anchor_paths(spec: JobSpec, base: Path) -> None:
    """The entry script and the pre-start hook are named relative to the job file; the
    nodes need them absolute. A missing file is an input error now, not a failed launch."""
    job = spec.job
    if job.entry and job.entry[0].endswith(".py"):
        job.entry[0] = str(_existing(base, job.entry[0], "job.entry"))
    if job.pre_start:
        job.pre_start = str(_existing(base, job.pre_start, "job.pre_start"))


def _existing(base: Path, name: str, key: str) -> Path:
    try:
        path = (base / name).resolve()
        found = path.is_file()
    except (OSError, ValueError):  # a NUL byte, a name too long
        raise JobFileError(f"{key} = {name!r}: not a usable file name") from None
    if not found:
        raise JobFileError(f"{key} = {name!r}: no such file ({str(path)!r})")
    return path


def apply_override(raw: dict[str, Any], item: str) -> None:
    """``a.b=value``: the value is read as a TOML value (``300``, ``true``, ``"x"``) and,
    if that fails, as a bare string, so ``--set train.data=/data/x.bin`` works."""
    key, sep, text = item.partition("=")
    if not sep or not key or not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", key):
        raise JobFileError(f"--set {item!r}: expected key.path=value, e.g. train.steps=300")
    try:
        value = msgspec.toml.decode(f"v = {text}".encode())["v"]
    except UnicodeEncodeError:  # undecodable bytes in argv arrive as lone surrogates
        raise JobFileError(f"--set {key}: the value is not valid UTF-8") from None
    except msgspec.DecodeError:
        value = text
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parents[: i + 1])
            raise JobFileError(f"--set {key}: {where} is a value, not a table")
        node = child
    node[leaf] = value


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")

# Keys earlier job files may still set, and where each setting lives now (docs/jobfile.md):
# what opens a condition on a node is the agent's to judge, in its config.
REMOVED = {
    "policy.nvme_pause_us": "a latency spike is the node agent's nvme.spike_us (agent config)",
    "policy.nvme_resume_us": "recovery is the node agent's nvme.recover_us (agent config)",
    "policy.nvme_hold_s": "the hold is the node agent's nvme.hold_s (agent config)",
    "policy.gpu_warn_c": "the warning level is the node agent's gpu.warn_c (agent config)",
    "policy.gpu_critical_c": "critical is the node agent's gpu.critical_c (agent config)",
    "policy.heartbeat_missed": "the coordinator counts missed heartbeats, for every job alike",
}


def to_spec(raw: dict[str, Any], source: str) -> JobSpec:
    try:
        spec = msgspec.convert(raw, JobSpec)
    except msgspec.ValidationError as exc:
        raise JobFileError(f"{source}: {describe(str(exc), raw)}") from None
    if problem := _unsendable(raw, ""):
        raise JobFileError(f"{source}: {problem}")
    return spec


def _unsendable(value: Any, key: str) -> str | None:
    """A number JSON cannot carry to the coordinator (inf, nan: they would arrive as null)
    or that does not fit its 64-bit integers."""
    if isinstance(value, dict):
        return next((p for k, v in value.items() if (p := _unsendable(v, f"{key}.{k}"))), None)
    if isinstance(value, list):
        found = (_unsendable(v, f"{key}[{i}]") for i, v in enumerate(value))
        return next((p for p in found if p), None)
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key.lstrip('.')} = {value!r}: expected a finite number"
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        return f"{key.lstrip('.')} = {value}: out of range (64-bit)"
    return None


def describe(error: str, raw: dict[str, Any]) -> str:
    """Turn msgspec's ``Expected `int` >= 1, got -5 - at `$.train.steps``` into
    ``train.steps = -5: expected an int >= 1``."""
    match = _AT.match(error)
    msg, path = (match.group("msg"), match.group("path")) if match else (error, None)
    key = (path or "").lstrip(".")
    unknown = re.match(r"Object contains unknown field `([^`]+)`", msg)
    if unknown:
        full = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
        moved = f": removed; {REMOVED[full]}" if full in REMOVED else ""
        return f"unknown key {full!r}{moved}"
    missing = re.match(r"Object missing required field `([^`]+)`", msg)
    if missing:
        full = f"{key}.{missing.group(1)}" if key else missing.group(1)
        return f"missing required key {full!r}"
    value = _lookup(raw, key)
    shown = f" = {value!r}" if value is not _MISSING else ""
    detail = msg[0].lower() + msg[1:] if msg else "invalid"
    if msg.startswith("Invalid enum value") and (choices := _choices(key)):
        detail = "expected one of " + ", ".join(repr(c) for c in choices)
    return f"{key or 'job file'}{shown}: {detail}"


def _choices(key: str) -> list[Any] | None:
    """The values a ``Literal`` key of the job file allows, from JobSpec's own types."""
    info: Any = msgspec.inspect.type_info(JobSpec)
    for part in key.split("."):
        fields = {f.name: f.type for f in getattr(info, "fields", ())}
        if part not in fields:
            return None
        info = fields[part]
    if isinstance(info, msgspec.inspect.UnionType):  # e.g. an optional literal
        literals = [t for t in info.types if isinstance(t, msgspec.inspect.LiteralType)]
        info = literals[0] if literals else info
    return list(info.values) if isinstance(info, msgspec.inspect.LiteralType) else None


_MISSING = object()


def _lookup(raw: Any, key: str) -> Any:
    node = raw
    for part in filter(None, re.split(r"\.|\[(\d+)\]", key)):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node
