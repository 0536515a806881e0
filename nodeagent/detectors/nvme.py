"""NVMe latency events from ``nvme`` samples, with hysteresis.

The coordinator pauses a job on a spike and resumes it on recovery, so each event is an
action: a device hovering around one threshold must not produce a stream of them. Hence two
thresholds (spike above ``spike_us``, recover below ``recover_us``), an optional count of
consecutive samples above before declaring a spike, and a hold time under ``recover_us``
before declaring recovery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nodeagent.collectors.base import Sample
from proto.events import EventBase, NvmeLatencyRecovered, NvmeLatencySpike, Severity


@dataclass
class _DeviceState:
    spiking: bool = False
    above: int = 0  # consecutive samples above spike_us while not spiking
    held_s: float = 0.0  # measured time below recover_us while spiking
    below_since: float | None = None  # time of the last sample below recover_us, if unbroken


class NvmeLatencyDetector:
    """Per device: normal → spike → (held under ``recover_us`` for ``hold_s``) → normal.

    The hold clock runs on sample times and only across consecutive samples under
    ``recover_us``: a sample at or above it resets the clock. An idle window (no I/O
    completed, none in flight) counts as under ``recover_us``: a job paused on a spike does
    no I/O, and must still be able to resume. A stalled window (I/O in flight, none
    completed) carries the window's length as its latency, so it is a spike. A window with
    no reading at all (a device's first, a counter reset) adds no time and resets nothing.
    """

    collector = "nvme"

    def __init__(
        self,
        node: str,
        *,
        spike_us: float = 100.0,
        recover_us: float = 50.0,
        hold_s: float = 3.0,
        confirm_samples: int = 1,
    ) -> None:
        if not 0 < recover_us <= spike_us:
            raise ValueError(f"need 0 < recover_us ({recover_us}) <= spike_us ({spike_us})")
        if hold_s < 0 or confirm_samples < 1:
            raise ValueError("need hold_s >= 0 and confirm_samples >= 1")
        self.node = node
        self.spike_us = spike_us
        self.recover_us = recover_us
        self.hold_s = hold_s
        self.confirm_samples = confirm_samples
        self._state: dict[str, _DeviceState] = {}

    def observe(self, sample: Sample) -> list[EventBase]:
        events: list[EventBase] = []
        devices: dict[str, dict[str, Any]] = sample.values.get("devices", {})
        for dev, reading in sorted(devices.items()):
            state = self._state.setdefault(dev, _DeviceState())
            latency = reading.get("latency_us")
            if latency is not None or reading.get("idle"):
                events.extend(self._latency(dev, state, latency, sample.time))
            else:
                state.below_since = None
        return events

    def _latency(
        self, dev: str, state: _DeviceState, measured: float | None, t: float
    ) -> list[EventBase]:
        """``measured`` None: an idle window."""
        latency = float(measured) if measured is not None else 0.0
        if not state.spiking:
            state.above = state.above + 1 if latency > self.spike_us else 0
            if state.above < self.confirm_samples:
                return []
            state.spiking, state.above, state.held_s, state.below_since = True, 0, 0.0, None
            message = f"{dev} latency {latency:.0f} µs above {self.spike_us:g} µs"
            return [
                NvmeLatencySpike(
                    severity=Severity.WARNING,
                    node=self.node,
                    device=dev,
                    latency_us=latency,
                    threshold_us=self.spike_us,
                    message=message,
                )
            ]
        if latency >= self.recover_us:
            state.held_s, state.below_since = 0.0, None
            return []
        if state.below_since is not None:
            state.held_s += max(0.0, t - state.below_since)
        state.below_since = t
        if state.held_s < self.hold_s:
            return []
        held = state.held_s
        state.spiking, state.held_s, state.below_since = False, 0.0, None
        now = f"latency {latency:.0f} µs" if measured is not None else "idle"
        message = f"{dev} {now}, under {self.recover_us:g} µs for {held:.1f} s"
        return [
            NvmeLatencyRecovered(
                node=self.node,
                device=dev,
                latency_us=latency,
                threshold_us=self.recover_us,
                held_s=held,
                message=message,
            )
        ]
