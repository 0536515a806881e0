"""The node's memory-tier snapshots of jobs that are gone: dropped, so RAM is not held
for ever by a job that failed, was stopped with a signal, or left this node.

A rank removes its job's snapshots itself when the job ends cleanly; a job that failed,
a rank killed, or a node left out of a job's next attempt leaves them in ``/dev/shm``
(tmpfs: RAM). The agent decides from what is there now, so its own restart loses
nothing: a store of this node's is dropped once no rank of its job runs here and the
store has not changed for :data:`~proto.node.RANK_MEMORY_S` (the time the agent keeps
reporting a job whose ranks all exited). A job still recovering elsewhere that comes
back after that resumes from its durable checkpoint instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog

from proto.job import MEMORY_STORE_PREFIX, memory_store_name, safe_name
from proto.node import RANK_MEMORY_S
from ringmaster.clock import SYSTEM, Clock
from ringmaster.memory_store import MemoryStore

log = structlog.get_logger()

SWEEP_EVERY_S = 30.0


@dataclass(frozen=True)
class Stale:
    store: Path  # <shm>/ringmaster-mem-<job>/<node>
    idle_s: float  # since it last changed


def _changed_at(store: Path) -> float:
    """When the store last changed: a step dir made, sealed or dropped."""
    times = [store.stat().st_mtime]
    for child in store.iterdir():
        times.append(child.stat().st_mtime)
    return max(times)


def stale_stores(
    shm: Path, node: str, live_jobs: Iterable[str], now: float, keep_s: float = RANK_MEMORY_S
) -> list[Stale]:
    """This node's stores under ``shm`` of jobs not in ``live_jobs`` (jobs with a rank
    running here), unchanged for over ``keep_s`` (wall-clock ``now``)."""
    live = {memory_store_name(job) for job in live_jobs}
    found = []
    for job_dir in sorted(shm.glob(MEMORY_STORE_PREFIX + "*")):
        store = job_dir / safe_name(node)
        if job_dir.name in live or not store.is_dir():
            continue
        try:
            idle = now - _changed_at(store)
        except OSError:
            continue  # removed meanwhile (a rank's clean end)
        if idle > keep_s:
            found.append(Stale(store, idle))
    return found


def sweep(shm: Path, node: str, live_jobs: Iterable[str], now: float) -> list[Stale]:
    """Drop the stale stores (and a job's dir once no node's store is left in it)."""
    dropped = stale_stores(shm, node, live_jobs, now)
    for stale in dropped:
        MemoryStore(stale.store).clear()
        log.info(
            "memory snapshots dropped",
            store=str(stale.store),
            why=f"no rank of the job on this node, unchanged for {stale.idle_s:.0f} s",
        )
    return dropped


async def run(
    shm: Path, node: str, live_jobs: Callable[[], Iterable[str]], clock: Clock = SYSTEM
) -> None:
    """Sweep every :data:`SWEEP_EVERY_S` at ``clock``'s wall time (the stores' times are
    the filesystem's, on the wall clock); a failed sweep is logged and tried again."""
    while True:
        try:
            sweep(shm, node, live_jobs(), clock.time())
        except OSError as exc:
            log.warning("memory snapshot sweep failed", error=str(exc))
        await asyncio.sleep(SWEEP_EVERY_S)
