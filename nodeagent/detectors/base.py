"""The detector contract: samples in, events out. Pure (no I/O), so tests feed samples.

A detector is generic over the sample type it reads, so registering it with a collector
that produces something else is a type error. A two-state detector opens and closes its
conditions through :mod:`nodeagent.detectors.latch` and sets ``event.condition`` on the
event that announces each change; the agent's set of active conditions follows those.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

from nodeagent.collectors.base import Sample
from proto.conditions import Condition
from proto.events import EventBase

S_contra = TypeVar("S_contra", bound=Sample, contravariant=True)


class Detector(Protocol[S_contra]):
    def observe(self, sample: S_contra) -> list[EventBase]: ...


@runtime_checkable
class Unannounced(Protocol):
    """A detector whose conditions can also close with no contract event to announce it (a
    withdrawn spot notice): the daemon takes those changes after each ``observe``, for the
    active set its heartbeats carry."""

    def unannounced(self) -> list[Condition]: ...
