"""How a rank starts cold: its command line, and a new interpreter in its own session with
its log and CPUs (``nodeagent.supervisor`` hands the built-in trainer's ranks to a warm
interpreter instead when one is ready, ``nodeagent.warm_pool``)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path


def rank_argv(argv: list[str]) -> list[str]:
    """The rank's command line. The built-in trainer runs as its own process, never
    imported: the agent does not depend on the trainer's code."""
    if not argv:
        return [sys.executable, "-m", "trainer.worker"]
    if argv[0].endswith(".py"):
        return [sys.executable, *argv]
    return argv


async def start_cold(
    argv: list[str], env: dict[str, str], cwd: Path, logpath: Path, cpus: list[int]
) -> asyncio.subprocess.Process:
    """A new interpreter for the rank: ``exec`` with its own session, log and CPUs."""
    with logpath.open("ab") as logf:
        return await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            start_new_session=True,
            preexec_fn=_affinity(cpus),
        )


def rank_cpus(cpus: list[int]) -> set[int] | None:
    """The rank's CPUs among those this agent may use (all of them if none are); None:
    no affinity asked for."""
    if not cpus:
        return None
    available = os.sched_getaffinity(0)
    return {c for c in cpus if c in available} or available


def _affinity(cpus: list[int]) -> Callable[[], None] | None:
    chosen = rank_cpus(cpus)
    if chosen is None:
        return None

    def apply() -> None:
        os.sched_setaffinity(0, chosen)

    return apply
