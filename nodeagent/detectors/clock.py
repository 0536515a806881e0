"""``clock.drift`` from ``clock`` samples: unsynchronised, or off by more than
``max_offset_ms`` beyond the measurement's own uncertainty.

The coordinator answers a drift with a resync (and drains the node if it persists), so the
event must not flap: the node-wide ``clock.drift`` condition opens after ``confirm`` bad
samples and closes (``recovered``) only once the clock is synchronised and within
``recover_ms`` for ``hold_s``: an offset between the two thresholds neither opens nor
closes it. The uncertainty (``bound_ms``) is subtracted before comparing with
``max_offset_ms``: a slow round trip is not a wrong clock.

Only a measured offset out of bounds makes the node unfit: the condition is at ``warning``
severity while it is (a second latch with the same hysteresis, so the node does not flap
between fit and unfit either). A clock the kernel or chrony calls unsynchronised whose
offset is in bounds, or not measured at all (no NTP daemon, no coordinator answer yet),
keeps the condition at ``info``: advisory, the node stays ready and the operator sees why.
"""

from __future__ import annotations

from nodeagent.collectors.clock import ClockSample
from nodeagent.config import ClockSettings
from nodeagent.detectors.latch import Change, ConditionLatch, Latch
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
        self._drift = self._new_drift()

    def _new_drift(self) -> Latch:
        return Latch(self.settings.confirm, self.settings.hold_s)

    def observe(self, sample: ClockSample) -> list[EventBase]:
        offset, bound, synced = sample.offset_ms, sample.bound_ms or 0.0, sample.synced
        bad = not synced or bool(self._out(offset, bound, self._latch.open))
        drifted = self._drift.raised
        change = self._latch.update(bad, sample.time)
        self._drift.update(self._out(offset, bound, drifted), sample.time)
        if change is Change.CLEARED:
            self._drift = self._new_drift()  # closed: whatever reopens it is judged afresh
        elif change is None and not (self._latch.open and self._drift.raised != drifted):
            return []
        recovered = change is Change.CLEARED
        measured = self._drift.raised
        shown = "no offset source" if offset is None else f"offset {offset:+.2f} ms"
        if recovered:
            message = f"clock back in bounds: {shown}, synchronised"
        elif measured:
            message = f"clock {shown} (±{bound:.2f}) beyond {self.settings.max_offset_ms:g} ms"
            message += "" if synced else ", unsynchronised"
        else:
            message = f"clock unsynchronised ({shown})"
        if recovered:
            threshold = self.settings.recover_ms
            condition = self._latch.record(
                Change.CLEARED, sample.time, reason=message, value=offset, threshold=threshold
            )
        else:  # opened, or its severity changed while open
            condition = self._latch.restate(
                sample.time,
                reason=message,
                value=offset if synced or measured else None,  # unsynchronised: untrusted
                threshold=self.settings.max_offset_ms,
                severity=Severity.WARNING if measured else Severity.INFO,
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

    def _out(self, offset: float | None, bound: float, recovering: bool) -> bool | None:
        """Whether the measured offset is out of bounds (None: nothing measured): beyond
        ``max_offset_ms`` to open, still beyond ``recover_ms`` while open."""
        if offset is None:
            return None
        if recovering:
            return abs(offset) > self.settings.recover_ms
        return abs(offset) - bound > self.settings.max_offset_ms
