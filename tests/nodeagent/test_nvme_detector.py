"""NvmeLatencyDetector: one event per state change, hysteresis, hold clock on sample time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from nodeagent.collectors.base import Sample
from nodeagent.detectors.nvme import NvmeLatencyDetector
from proto.events import EventBase, NvmeLatencyRecovered, NvmeLatencySpike

STEP = 0.5


def feed(
    detector: NvmeLatencyDetector,
    latencies: Sequence[float | None],
    *,
    start: float = 0.0,
    device: str = "nvme0n1",
    idle: bool = False,
) -> list[tuple[float, EventBase]]:
    """Feed one sample per latency, STEP apart; returns (sample time, event) pairs. A None
    latency is an idle window with ``idle``, else a window without a reading."""
    out: list[tuple[float, EventBase]] = []
    for i, latency in enumerate(latencies):
        t = start + i * STEP
        reading = {"latency_us": latency, "iops": 4000.0, "readonly": False}
        reading |= {"idle": idle and latency is None, "in_flight": 0, "stalled": False}
        values = {"devices": {device: reading}}
        out.extend(
            (t, e) for e in detector.observe(Sample(collector="nvme", time=t, values=values))
        )
    return out


def kinds(events: list[tuple[float, EventBase]]) -> list[str]:
    return [type(e).__name__ for _, e in events]


def test_spike_once_with_its_fields() -> None:
    events = feed(NvmeLatencyDetector("node-3"), [20, 21, 480, 510, 495, 505])
    assert kinds(events) == ["NvmeLatencySpike"]
    t, spike = events[0]
    assert t == 1.0
    assert isinstance(spike, NvmeLatencySpike)
    assert (spike.node, spike.device, spike.latency_us, spike.threshold_us) == (
        "node-3",
        "nvme0n1",
        480,
        100.0,
    )
    assert spike.severity == "warning"
    assert spike.message


def test_recovery_only_after_the_hold_time() -> None:
    detector = NvmeLatencyDetector("n", hold_s=3.0)
    feed(detector, [500])
    # Under 50 µs from t=10.0; 3 s of measured time below is reached at t=13.0.
    events = feed(detector, [30] * 10, start=10.0)
    assert [t for t, _ in events] == [13.0]
    recovered = events[0][1]
    assert isinstance(recovered, NvmeLatencyRecovered)
    assert (recovered.threshold_us, recovered.held_s, recovered.latency_us) == (50.0, 3.0, 30)
    assert recovered.severity == "info"


def test_a_sample_above_recover_resets_the_hold_clock() -> None:
    detector = NvmeLatencyDetector("n", hold_s=3.0)
    feed(detector, [500])
    assert feed(detector, [30, 30, 30, 30, 30, 60], start=10.0) == []  # 2.5 s held, then reset
    events = feed(detector, [30] * 8, start=13.0)
    assert [t for t, _ in events] == [16.0]


def test_no_flapping_around_the_spike_threshold() -> None:
    events = feed(NvmeLatencyDetector("n"), [99, 101, 99, 101, 99, 101, 99, 101] * 5)
    assert kinds(events) == ["NvmeLatencySpike"]


def test_no_flapping_around_the_recover_threshold() -> None:
    detector = NvmeLatencyDetector("n")
    feed(detector, [500])
    assert feed(detector, [49, 51] * 40, start=1.0) == []


def test_spike_and_recovery_repeat_per_episode() -> None:
    detector = NvmeLatencyDetector("n", hold_s=1.0)
    trace = [500, 30, 30, 30, 500, 500, 30, 30, 30, 30]
    assert kinds(feed(detector, trace)) == [
        "NvmeLatencySpike",
        "NvmeLatencyRecovered",
        "NvmeLatencySpike",
        "NvmeLatencyRecovered",
    ]


def test_confirm_samples_needs_consecutive_samples_above() -> None:
    detector = NvmeLatencyDetector("n", confirm_samples=3)
    assert feed(detector, [500, 500, 20, 500, 500, 20]) == []
    events = feed(detector, [500, 500, 500, 500], start=10.0)
    assert [t for t, _ in events] == [11.0]


def test_windows_without_a_reading_are_neither_spike_nor_recovery() -> None:
    detector = NvmeLatencyDetector("n", hold_s=1.0)
    assert feed(detector, [None] * 10) == []
    feed(detector, [500], start=10.0)
    # 0.5 s held, a stretch without readings that adds no time, then 0.5 s more.
    assert feed(detector, [30, 30, None, None, None, None], start=11.0) == []
    events = feed(detector, [30, 30, 30], start=20.0)
    assert [(t, type(e).__name__) for t, e in events] == [(20.5, "NvmeLatencyRecovered")]
    assert isinstance(events[0][1], NvmeLatencyRecovered) and events[0][1].held_s == 1.0


def test_an_idle_device_recovers() -> None:
    """A job paused on a spike stops its I/O: idle windows must count towards recovery, or
    the job would never resume."""
    detector = NvmeLatencyDetector("n", hold_s=1.0)
    assert feed(detector, [None] * 10, idle=True) == [], "idle is not a spike"
    feed(detector, [500], start=10.0)
    events = feed(detector, [None] * 4, start=11.0, idle=True)
    assert [t for t, _ in events] == [12.0]
    recovered = events[0][1]
    assert isinstance(recovered, NvmeLatencyRecovered) and recovered.latency_us == 0.0
    assert recovered.message == "nvme0n1 idle, under 50 µs for 1.0 s"


def test_a_stall_is_a_spike() -> None:
    """The collector reports a stalled window with the window's length as its latency."""
    events = feed(NvmeLatencyDetector("n"), [20, 500_000.0])
    assert kinds(events) == ["NvmeLatencySpike"]


def test_devices_are_independent() -> None:
    detector = NvmeLatencyDetector("n")
    feed(detector, [500], device="nvme1n1")
    events = feed(detector, [500, 500], device="nvme0n1")
    assert [e.device for _, e in events if isinstance(e, NvmeLatencySpike)] == ["nvme0n1"]


def test_errors_only_samples_emit_nothing() -> None:
    sample = Sample(collector="nvme", time=0.0, values={"devices": {}, "errors": {"x": "y"}})
    assert NvmeLatencyDetector("n").observe(sample) == []


@pytest.mark.parametrize(
    "kwargs",
    [{"recover_us": 200.0}, {"recover_us": 0.0}, {"hold_s": -1.0}, {"confirm_samples": 0}],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        NvmeLatencyDetector("n", **kwargs)
