"""Kernel tunables preflight recommends, read from ``<procfs>/sys`` and, where the agent
may, raised to their recommended value.

A tunable under its recommendation is a warning, never a refusal: the kernel's default
serves small worlds, and a host running stock settings is still a usable node. The agent
raises it itself only as the host's own root service: euid 0 under systemd, which sets
``INVOCATION_ID`` (and ``NOTIFY_SOCKET`` for a notify service) in a unit's environment.
A root shell running ``nodeagent --preflight``, or a test, must not retune the machine it
runs on. It does so on its first reading only, at start, like ``systemd-sysctl`` at boot:
a value an operator lowers while the agent runs is the operator's choice, and stays a
warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from proto.events import PreflightCheck

log = structlog.get_logger()

SOMAXCONN = "net.core.somaxconn"


@dataclass(frozen=True)
class Tunable:
    name: str  # the check's name: "somaxconn"
    key: str  # sysctl's name: "net.core.somaxconn"
    minimum: int  # the recommended value, from the agent's settings

    def path(self, procfs: Path) -> Path:
        return procfs.joinpath("sys", *self.key.split("."))


def may_fix(env: Mapping[str, str], euid: int) -> bool:
    """Whether this process is the host's root service, the one allowed to retune it."""
    return euid == 0 and bool(env.get("INVOCATION_ID") or env.get("NOTIFY_SOCKET"))


def read_int(path: Path) -> int:
    """One integer, as procfs holds it; anything else is a one-line ``ValueError``."""
    text = path.read_bytes().decode(errors="replace").strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text[:40]!r}") from None


def check(tunable: Tunable, procfs: Path, *, fix: bool) -> PreflightCheck:
    """The tunable's check, never required; with ``fix``, a value under the minimum is
    raised to it first and the check says what it was."""
    want = f">= {tunable.minimum}"
    path = tunable.path(procfs)
    try:
        value = read_int(path)
    except (OSError, ValueError) as exc:
        return _check(tunable, False, f"unreadable: {why(exc)}", want)
    if value >= tunable.minimum or not fix:
        return _check(tunable, value >= tunable.minimum, str(value), want)
    try:
        path.write_text(f"{tunable.minimum}\n")
        now = read_int(path)
    except (OSError, ValueError) as exc:
        log.warning("sysctl_not_raised", sysctl=tunable.key, value=value, error=why(exc))
        return _check(tunable, False, str(value), want)
    log.info("sysctl_raised", sysctl=tunable.key, change=f"{value} -> {now}")
    return _check(tunable, now >= tunable.minimum, str(now), want, fixed_from=str(value))


def why(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return str(exc)


def _check(
    tunable: Tunable, ok: bool, value: str, want: str, *, fixed_from: str = ""
) -> PreflightCheck:
    return PreflightCheck(
        name=tunable.name, ok=ok, value=value, want=want, required=False, fixed_from=fixed_from
    )
