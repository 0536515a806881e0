"""The collector contract: one hardware signal, read from its real interface.

A collector is cheap and synchronous (a few file reads or library calls); the daemon runs
each on its own interval in a worker thread and times it. A collector that fails raises;
the daemon records the error in that collector's :class:`CollectorStatus` and keeps going.
Roots (``/sys``, ``/proc``, ``/dev``, URLs, library paths) come from :class:`Roots` so the
same code reads a real node, a fixture tree or a simulated node.

Each collector returns its own :class:`Sample` subclass, defined next to it, with typed
fields and nested structs: a detector is declared against the sample type it reads
(``Detector[NvmeLatencySample]``), so mypy checks that it reads what its collector writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

import msgspec
from nats.aio.client import Client


@dataclass(frozen=True)
class Roots:
    sysfs: Path = Path("/sys")
    procfs: Path = Path("/proc")
    dev: Path = Path("/dev")
    extra: dict[str, str] = field(default_factory=dict)


class Sample(msgspec.Struct, kw_only=True):
    """What every reading has: when it was taken (wall-clock seconds, the time hysteresis
    runs on). msgspec encodes every subclass as it is, for ``nodeagent --once --json``."""

    time: float


S_co = TypeVar("S_co", bound=Sample, covariant=True)


class Collector(Protocol[S_co]):
    name: str
    interval_s: float

    def collect(self, now: float) -> S_co: ...


@runtime_checkable
class Wakeable(Protocol):
    """A collector whose source can announce news (uevents, XIDs): the sampling loop also
    collects as soon as ``fileno()`` turns readable. None: nothing to wait on yet."""

    def fileno(self) -> int | None: ...


@runtime_checkable
class Closable(Protocol):
    """A collector holding a thread or a socket, released when the agent stops."""

    def close(self) -> None: ...


@runtime_checkable
class BusAttached(Protocol):
    """A collector that also measures over NATS (the clock's offset to the coordinator):
    the daemon runs ``attach`` as a task for as long as it is connected."""

    async def attach(self, nc: Client, cluster: str) -> None: ...


class CollectorUnavailable(Exception):
    """Raised when the signal's source is absent on this node (no NVML, no NVMe): reported
    as a clean 'not available' status, never a crash."""
