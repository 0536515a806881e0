"""Running collectors (each failing alone, woken by its source) and what heartbeats carry."""

from __future__ import annotations

import asyncio
import os
import selectors
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest

from nodeagent.collectors.base import CollectorUnavailable, Sample
from nodeagent.collectors.clock import ClockSample
from nodeagent.collectors.gpu import GpuHealthSample, GpuIdentity, GpuReading
from nodeagent.collectors.nvme import NvmeDeviceReading, NvmeLatencySample
from nodeagent.collectors.preemption import Notice, PreemptionSample
from nodeagent.config import NvmeSettings
from nodeagent.detectors.nvme import NvmeLatencyDetector
from nodeagent.detectors.preemption import SpotNoticeDetector
from nodeagent.registry import Registered
from nodeagent.sampling import (
    WAKE_GAP_S,
    ActiveConditions,
    close_all,
    pause,
    run_once,
    summarize,
)
from proto.conditions import Condition, ConditionKind, condition_key
from proto.events import GpuXid, NvmeLatencySpike
from proto.node import GpuSample, Telemetry
from ringmaster.clock import EPOCH, ManualClock

T = TypeVar("T")


class _Jumping(selectors.DefaultSelector):
    """Polls the file descriptors for real; when none is ready and the loop would wait for
    its next timer, moves ``clock`` to that timer instead of waiting."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer: only a file descriptor can wake the loop
            return super().select(None)
        self.clock.advance(timeout)
        return []


def on_virtual_time(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` on an event loop whose clock is a manual one that jumps to the next
    timer whenever everything waits: sleeps and timeouts take no real time, and a duration
    read from ``loop.time()`` is exactly what the loop waited."""
    clock = ManualClock()

    def virtual() -> asyncio.AbstractEventLoop:
        loop = asyncio.SelectorEventLoop(_Jumping(clock))
        loop.time = clock.monotonic  # type: ignore[method-assign]
        return loop

    with asyncio.Runner(loop_factory=virtual) as runner:
        return runner.run(work)


class FakeSample(Sample, kw_only=True):
    n: int


@dataclass
class Fake:
    name: str = "fake"
    interval_s: float = 1.0
    error: Exception | None = None
    closed: bool = False
    read_fd: int | None = None
    calls: list[float] = field(default_factory=list)

    def collect(self, now: float) -> FakeSample:
        self.calls.append(now)
        if self.error is not None:
            raise self.error
        return FakeSample(time=now, n=len(self.calls))

    def close(self) -> None:
        self.closed = True


@dataclass
class WakeableFake(Fake):
    def fileno(self) -> int | None:
        return self.read_fd


def test_each_collector_fails_alone() -> None:
    sample, status = run_once(Registered(Fake()), 5.0)
    assert sample == FakeSample(time=5.0, n=1) and status.ok
    broken = Registered(Fake(name="broken", error=RuntimeError("bad sysfs parser")))
    sample, status = run_once(broken, 5.0)
    assert sample is None and not status.ok
    assert status.error == "RuntimeError('bad sysfs parser')" and status.name == "broken"
    absent = Registered(Fake(name="gpu", error=CollectorUnavailable("no NVML: not found")))
    assert run_once(absent, 5.0)[1].error == "unavailable: no NVML: not found"


def test_pause_ends_early_when_the_source_has_news() -> None:
    read_fd, write_fd = os.pipe()
    try:

        async def timed(collector: Fake, seconds: float, poke: bool) -> float:
            loop = asyncio.get_running_loop()
            start = loop.time()
            if poke:
                loop.call_later(0.05, os.write, write_fd, b"x")
            await pause(collector, seconds)
            return loop.time() - start

        woken = WakeableFake(read_fd=read_fd)
        news = 0.05 + WAKE_GAP_S  # woken at the poke, then the gap that stops a spin
        assert on_virtual_time(timed(woken, 5.0, poke=True)) == pytest.approx(news)
        os.read(read_fd, 16)
        assert on_virtual_time(timed(woken, 0.2, poke=False)) == pytest.approx(0.2)
        no_fd = on_virtual_time(timed(WakeableFake(), 0.1, poke=False))
        assert no_fd == pytest.approx(0.1), "no fd yet"
        assert on_virtual_time(timed(Fake(), 0.1, poke=False)) == pytest.approx(0.1)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_close_all_releases_what_collectors_hold() -> None:
    fake = Fake()
    close_all([Registered(fake)])
    assert fake.closed


def test_summaries_for_heartbeats() -> None:
    telemetry = Telemetry()
    nvme = {
        "nvme0n1": NvmeDeviceReading(readonly=False, in_flight=0, latency_us=21.04),
        "nvme1n1": NvmeDeviceReading(readonly=False, in_flight=0),
    }
    summarize(telemetry, NvmeLatencySample(time=0, devices=nvme))
    identity = GpuIdentity(name="H100", uuid="u", bus_id="b", slowdown_c=None, shutdown_c=None)
    gpu = GpuReading(index=0, identity=identity, temp_c=61, util_pct=97, mem_used_mb=1024.0)
    summarize(telemetry, GpuHealthSample(time=0, gpus=[gpu]))
    summarize(telemetry, ClockSample(time=0, offset_ms=-0.4))
    summarize(telemetry, FakeSample(time=0, n=1))  # nothing a heartbeat carries
    assert telemetry.nvme_latency_us == {"nvme0n1": 21.0}
    assert telemetry.gpus == (GpuSample(index=0, temp_c=61, util_pct=97, mem_used_mb=1024.0),)
    assert telemetry.clock_offset_ms == -0.4


def test_the_active_set_follows_what_detectors_open_and_close() -> None:
    """What the heartbeat carries: every open condition, by key, from the events that
    opened them; closed ones leave, whether an event or the detector alone closed them."""
    active = ActiveConditions()
    nvme = NvmeLatencyDetector("node-1", NvmeSettings(hold_s=0.0))
    spot = SpotNoticeDetector("node-1")

    def latency(t: float, us: float) -> None:
        reading = NvmeDeviceReading(readonly=False, in_flight=0, latency_us=us)
        for event in nvme.observe(NvmeLatencySample(time=t, devices={"nvme0n1": reading})):
            active.observe(event)

    latency(0, 500)
    notice = Notice(action="terminate", deadline=datetime.fromtimestamp(EPOCH, UTC), detail="")
    for event in spot.observe(PreemptionSample(time=1, provider="aws", notice=notice)):
        active.observe(event)
    active.observe(GpuXid(gpu=0, xid=79))  # a one-shot event: no condition
    nvme_key = condition_key(ConditionKind.NVME_LATENCY, "node-1", "nvme0n1")
    spot_key = condition_key(ConditionKind.PREEMPTION, "node-1", "aws")
    assert [c.key for c in active.conditions()] == sorted([nvme_key, spot_key])
    latency(2, 20)
    assert [c.key for c in active.conditions()] == [spot_key]
    spot.observe(PreemptionSample(time=3, provider="aws"))
    for condition in spot.unannounced():
        active.apply(condition)
    assert active.conditions() == []


def test_a_restated_condition_replaces_the_open_one() -> None:
    active = ActiveConditions()
    kind = ConditionKind.GPU_THERMAL
    active.apply(Condition(kind=kind, node="n", subject="3", severity="warning", since=1))
    active.apply(Condition(kind=kind, node="n", subject="3", severity="critical", since=2))
    active.observe(NvmeLatencySpike(device="nvme0n1"))  # no condition: changes nothing
    [only] = active.conditions()
    assert (only.key, only.severity) == (condition_key(kind, "n", "3"), "critical")
