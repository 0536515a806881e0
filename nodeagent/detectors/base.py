"""The detector contract: samples in, events out. Pure (no I/O), so tests feed samples."""

from __future__ import annotations

from typing import Protocol

from nodeagent.collectors.base import Sample
from proto.events import EventBase


class Detector(Protocol):
    collector: str  # the collector whose samples this detector reads

    def observe(self, sample: Sample) -> list[EventBase]: ...
