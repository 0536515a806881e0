"""NvmeLatencyDetector: one event per state change, hysteresis, hold on sample time, and
the one ``nvme.latency`` condition per device that those events open and close."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nodeagent.collectors.nvme import NvmeDeviceReading, NvmeLatencySample
from nodeagent.config import NvmeSettings
from nodeagent.detectors.nvme import NvmeLatencyDetector
from proto.conditions import ConditionKind, condition_key
from proto.events import EventBase, NvmeLatencyRecovered, NvmeLatencySpike

STEP = 0.5


def detector(node: str = "n", **settings: Any) -> NvmeLatencyDetector:
    return NvmeLatencyDetector(node, NvmeSettings(**settings))


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
        reading = NvmeDeviceReading(
            readonly=False,
            in_flight=0,
            latency_us=latency,
            iops=4000.0,
            idle=idle and latency is None,
        )
        sample = NvmeLatencySample(time=t, devices={device: reading})
        out.extend((t, e) for e in detector.observe(sample))
    return out


def kinds(events: list[tuple[float, EventBase]]) -> list[str]:
    return [type(e).__name__ for _, e in events]


def test_spike_once_with_its_fields() -> None:
    events = feed(detector("node-3"), [20, 21, 480, 510, 495, 505])
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


def test_spike_and_recovery_open_and_close_one_condition() -> None:
    nvme = detector("node-3", hold_s=1.0)
    spike = feed(nvme, [20, 480])[0][1]
    recovered = feed(nvme, [30, 30, 30], start=5.0)[0][1]
    key = condition_key("nvme.latency", "node-3", "nvme0n1")
    opened, closed = spike.condition, recovered.condition
    assert opened is not None and closed is not None
    assert opened.key == closed.key == key
    assert (opened.kind, opened.subject, opened.active, opened.since) == (
        ConditionKind.NVME_LATENCY,
        "nvme0n1",
        True,
        0.5,
    )
    assert (opened.value, opened.threshold, opened.severity) == (480, 100.0, "warning")
    assert opened.reason == spike.message == "nvme0n1 latency 480 µs above 100 µs"
    assert (closed.active, closed.since, closed.value, closed.threshold) == (False, 6.0, 30, 50.0)
    assert closed.reason == recovered.message


def test_recovery_only_after_the_hold_time() -> None:
    nvme = detector(hold_s=3.0)
    feed(nvme, [500])
    # Under 50 µs from t=10.0; 3 s of measured time below is reached at t=13.0.
    events = feed(nvme, [30] * 10, start=10.0)
    assert [t for t, _ in events] == [13.0]
    recovered = events[0][1]
    assert isinstance(recovered, NvmeLatencyRecovered)
    assert (recovered.threshold_us, recovered.held_s, recovered.latency_us) == (50.0, 3.0, 30)
    assert recovered.severity == "info"


def test_a_sample_above_recover_resets_the_hold_clock() -> None:
    nvme = detector(hold_s=3.0)
    feed(nvme, [500])
    assert feed(nvme, [30, 30, 30, 30, 30, 60], start=10.0) == []  # 2.5 s held, then reset
    events = feed(nvme, [30] * 8, start=13.0)
    assert [t for t, _ in events] == [16.0]


def test_no_flapping_around_the_spike_threshold() -> None:
    events = feed(detector(), [99, 101, 99, 101, 99, 101, 99, 101] * 5)
    assert kinds(events) == ["NvmeLatencySpike"]


def test_no_flapping_around_the_recover_threshold() -> None:
    nvme = detector()
    feed(nvme, [500])
    assert feed(nvme, [49, 51] * 40, start=1.0) == []


def test_spike_and_recovery_repeat_per_episode() -> None:
    nvme = detector(hold_s=1.0)
    trace = [500, 30, 30, 30, 500, 500, 30, 30, 30, 30]
    events = feed(nvme, trace)
    assert kinds(events) == [
        "NvmeLatencySpike",
        "NvmeLatencyRecovered",
        "NvmeLatencySpike",
        "NvmeLatencyRecovered",
    ]
    conditions = [e.condition for _, e in events]
    assert [(c.active, c.key) for c in conditions if c is not None] == [
        (True, condition_key(ConditionKind.NVME_LATENCY, "n", "nvme0n1")),
        (False, condition_key(ConditionKind.NVME_LATENCY, "n", "nvme0n1")),
    ] * 2


def test_settings_change_the_thresholds_and_the_hold() -> None:
    """The detector reads its section of the agent's settings: no thresholds of its own."""
    strict = detector(spike_us=30.0, recover_us=10.0, hold_s=0.0)
    events = feed(strict, [20, 35, 15, 9])
    assert [(t, type(e).__name__) for t, e in events] == [
        (0.5, "NvmeLatencySpike"),
        (1.5, "NvmeLatencyRecovered"),
    ]
    assert isinstance(events[0][1], NvmeLatencySpike) and events[0][1].threshold_us == 30.0
    assert feed(detector(), [20, 35, 15, 9]) == [], "35 µs is no spike at the defaults"


def test_windows_without_a_reading_are_neither_spike_nor_recovery() -> None:
    nvme = detector(hold_s=1.0)
    assert feed(nvme, [None] * 10) == []
    feed(nvme, [500], start=10.0)
    # 0.5 s held, a stretch without readings that adds no time, then 0.5 s more.
    assert feed(nvme, [30, 30, None, None, None, None], start=11.0) == []
    events = feed(nvme, [30, 30, 30], start=20.0)
    assert [(t, type(e).__name__) for t, e in events] == [(20.5, "NvmeLatencyRecovered")]
    assert isinstance(events[0][1], NvmeLatencyRecovered) and events[0][1].held_s == 1.0


def test_an_idle_device_recovers() -> None:
    """A job paused on a spike stops its I/O: idle windows must count towards recovery, or
    the job would never resume."""
    nvme = detector(hold_s=1.0)
    assert feed(nvme, [None] * 10, idle=True) == [], "idle is not a spike"
    feed(nvme, [500], start=10.0)
    events = feed(nvme, [None] * 4, start=11.0, idle=True)
    assert [t for t, _ in events] == [12.0]
    recovered = events[0][1]
    assert isinstance(recovered, NvmeLatencyRecovered) and recovered.latency_us == 0.0
    assert recovered.message == "nvme0n1 idle, under 50 µs for 1.0 s"


def test_a_stall_is_a_spike() -> None:
    """The collector reports a stalled window with the window's length as its latency."""
    events = feed(detector(), [20, 500_000.0])
    assert kinds(events) == ["NvmeLatencySpike"]


def test_devices_are_independent() -> None:
    nvme = detector()
    feed(nvme, [500], device="nvme1n1")
    events = feed(nvme, [500, 500], device="nvme0n1")
    assert [e.device for _, e in events if isinstance(e, NvmeLatencySpike)] == ["nvme0n1"]
    assert [e.condition.subject for _, e in events if e.condition] == ["nvme0n1"]


def test_errors_only_samples_emit_nothing() -> None:
    sample = NvmeLatencySample(time=0.0, errors={"x": "y"})
    assert detector().observe(sample) == []
