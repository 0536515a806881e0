"""``clock.drift`` from ``clock`` samples: unsynchronised, or off by more than
``max_offset_ms`` beyond the measurement's own uncertainty.

The coordinator answers a drift with a resync (and drains the node if it persists), so the
event must not flap: the node-wide ``clock.drift`` condition opens after ``confirm`` bad
samples and closes (``recovered``) only once the clock is synchronised and within
``recover_ms`` for ``hold_s``: an offset between the two thresholds neither opens nor
closes it. The uncertainty (``bound_ms``) is subtracted before comparing with
``max_offset_ms``: a slow round trip is not a wrong clock.
"""

from __future__ import annotations

from nodeagent.collectors.clock import ClockSample
from nodeagent.config import ClockSettings
from nodeagent.detectors.latch import Change, ConditionLatch
from proto.conditions import ConditionKind, Severity
from proto.events import ClockDrift, EventBase


class ClockDriftDetector:
    def __init__(self, node: str, settings: ClockSettings) -> None:
        self.node = node
        self.settings = settings
        self._latch = ConditionLatch(
            ConditionKind.CLOCK,
            node,
            "",
            severity=Severity.WARNING,
            confirm=settings.confirm,
            hold_s=settings.hold_s,
        )

    def observe(self, sample: ClockSample) -> list[EventBase]:
        offset, bound, synced = sample.offset_ms, sample.bound_ms or 0.0, sample.synced
        bad: bool
        if not synced:
            bad = True
        elif offset is None:
            bad = False
        elif self._latch.open:  # recovering: must come within recover_ms, and stay
            bad = abs(offset) > self.settings.recover_ms
        else:
            bad = abs(offset) - bound > self.settings.max_offset_ms
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
            message = f"clock {shown} (±{bound:.2f}) beyond {self.settings.max_offset_ms:g} ms"
        condition = self._latch.record(
            change,
            sample.time,
            reason=message,
            value=offset if synced else None,  # unsynchronised: no offset to trust
            threshold=self.settings.recover_ms if recovered else self.settings.max_offset_ms,
        )
        return [
            ClockDrift(
                severity=Severity.INFO if recovered else Severity.WARNING,
                node=self.node,
                offset_ms=offset if offset is not None else 0.0,
                synced=synced,
                source=sample.source,
                recovered=recovered,
                message=message,
                condition=condition,
            )
        ]
