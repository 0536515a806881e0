"""NVMe latency events from ``nvme`` samples, with hysteresis.

The coordinator pauses a job on a spike and resumes it on recovery, so each event is an
action: a device hovering around one threshold must not produce a stream of them. Hence two
thresholds (spike above ``spike_us``, recover below ``recover_us``) and a hold time under
``recover_us`` before declaring recovery, kept by the shared latch.
"""

from __future__ import annotations

from nodeagent.collectors.nvme import NvmeDeviceReading, NvmeLatencySample
from nodeagent.config import NvmeSettings
from nodeagent.detectors.latch import Change, ConditionLatch, ConditionLatches
from proto.conditions import ConditionKind, Severity
from proto.events import EventBase, NvmeLatencyRecovered, NvmeLatencySpike


class NvmeLatencyDetector:
    """Per device: normal → spike → (held under ``recover_us`` for ``hold_s``) → normal,
    one ``nvme.latency`` condition per device (subject: the device; value: µs).

    The hold runs on sample time and only across consecutive samples under ``recover_us``:
    a sample at or above it restarts the hold. An idle window (no I/O completed, none in
    flight) counts as under ``recover_us``: a job paused on a spike does no I/O, and must
    still be able to resume. A stalled window (I/O in flight, none completed) carries the
    window's length as its latency, so it is a spike. A window with no reading at all (a
    device's first, a counter reset) is no evidence: it adds no time and resets nothing.
    """

    def __init__(self, node: str, settings: NvmeSettings) -> None:
        self.node = node
        self.settings = settings
        self._latches = ConditionLatches(
            ConditionKind.NVME_LATENCY,
            node,
            severity=Severity.WARNING,
            confirm=1,
            hold_s=settings.hold_s,
        )

    def observe(self, sample: NvmeLatencySample) -> list[EventBase]:
        events: list[EventBase] = []
        for dev, reading in sorted(sample.devices.items()):
            latch = self._latches[dev]
            latency = _latency(reading)
            if latency is None:
                bad = None
            elif latch.open:
                bad = latency >= self.settings.recover_us
            else:
                bad = latency > self.settings.spike_us
            change = latch.update(bad, sample.time)
            if change is not None and latency is not None:
                events.append(self._event(dev, latch, change, latency, reading, sample.time))
        return events

    def _event(
        self,
        dev: str,
        latch: ConditionLatch,
        change: Change,
        latency: float,
        reading: NvmeDeviceReading,
        t: float,
    ) -> EventBase:
        spike_us, recover_us = self.settings.spike_us, self.settings.recover_us
        if change is Change.RAISED:
            message = f"{dev} latency {latency:.0f} µs above {spike_us:g} µs"
            condition = latch.record(change, t, reason=message, value=latency, threshold=spike_us)
            return NvmeLatencySpike(
                severity=Severity.WARNING,
                node=self.node,
                device=dev,
                latency_us=latency,
                threshold_us=spike_us,
                message=message,
                condition=condition,
            )
        held = latch.held_s
        now = "idle" if reading.idle else f"latency {latency:.0f} µs"
        message = f"{dev} {now}, under {recover_us:g} µs for {held:.1f} s"
        condition = latch.record(change, t, reason=message, value=latency, threshold=recover_us)
        return NvmeLatencyRecovered(
            node=self.node,
            device=dev,
            latency_us=latency,
            threshold_us=recover_us,
            held_s=held,
            message=message,
            condition=condition,
        )


def _latency(reading: NvmeDeviceReading) -> float | None:
    """The window's latency as evidence: an idle window is 0 µs, no reading is None."""
    if reading.latency_us is not None:
        return reading.latency_us
    return 0.0 if reading.idle else None
