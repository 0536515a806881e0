"""``clock.drift`` from ``clock`` samples: unsynchronised, or off by more than
``max_offset_ms`` beyond the measurement's own uncertainty.

The coordinator answers a drift with a resync (and drains the node if it persists), so the
event must not flap: it is raised after ``confirm`` bad samples and cleared (``recovered``)
only once the clock is synchronised and within ``recover_ms`` for ``hold_s``: an offset
between the two thresholds neither raises nor clears it. The uncertainty (``bound_ms``) is
subtracted before comparing with ``max_offset_ms``: a slow round trip is not a wrong clock.
"""

from __future__ import annotations

from nodeagent.collectors.base import Sample
from nodeagent.detectors.latch import Change, Latch
from proto.events import ClockDrift, EventBase, Severity


class ClockDriftDetector:
    collector = "clock"

    def __init__(
        self,
        node: str,
        *,
        max_offset_ms: float = 5.0,
        recover_ms: float = 2.0,
        confirm: int = 2,
        hold_s: float = 5.0,
    ) -> None:
        if not 0 < recover_ms <= max_offset_ms:
            raise ValueError(f"need 0 < recover_ms ({recover_ms}) <= max_offset_ms")
        self.node = node
        self.max_offset_ms = max_offset_ms
        self.recover_ms = recover_ms
        self._latch = Latch(confirm=confirm, hold_s=hold_s)

    def observe(self, sample: Sample) -> list[EventBase]:
        values = sample.values
        synced = bool(values.get("synced", True))
        offset, bound = values.get("offset_ms"), values.get("bound_ms") or 0.0
        bad: bool
        if not synced:
            bad = True
        elif offset is None:
            bad = False
        elif self._latch.raised:  # recovering: must come within recover_ms, and stay
            bad = abs(offset) > self.recover_ms
        else:
            bad = abs(offset) - bound > self.max_offset_ms
        change = self._latch.update(bad, sample.time)
        if change is None:
            return []
        recovered = change is Change.CLEARED
        shown = "no offset source" if offset is None else f"offset {offset:+.2f} ms"
        if recovered:
            message = f"clock back in bounds: {shown}, synchronised"
        elif not synced:
            message = f"clock unsynchronised ({shown})"
        else:
            message = f"clock {shown} (±{bound:.2f}) beyond {self.max_offset_ms:g} ms"
        return [
            ClockDrift(
                severity=Severity.INFO if recovered else Severity.WARNING,
                node=self.node,
                offset_ms=offset if offset is not None else 0.0,
                synced=synced,
                source=str(values.get("source", "")),
                recovered=recovered,
                message=message,
            )
        ]
