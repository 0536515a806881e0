"""Running collectors (each failing alone, woken by its source) and what heartbeats carry."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

from nodeagent.collectors.base import CollectorUnavailable, Sample
from nodeagent.registry import Registered
from nodeagent.sampling import Health, close_all, pause, run_once, summarize
from proto.events import (
    ClockDrift,
    GpuThermal,
    NodePreflight,
    NvmeLatencyRecovered,
    NvmeLatencySpike,
    PreflightCheck,
    SpotNotice,
    TopologyDegraded,
)
from proto.node import GpuSample, Telemetry


@dataclass
class Fake:
    name: str = "fake"
    interval_s: float = 1.0
    error: Exception | None = None
    closed: bool = False
    read_fd: int | None = None
    calls: list[float] = field(default_factory=list)

    def collect(self, now: float) -> Sample:
        self.calls.append(now)
        if self.error is not None:
            raise self.error
        return Sample(collector=self.name, time=now, values={"n": len(self.calls)})

    def close(self) -> None:
        self.closed = True


@dataclass
class WakeableFake(Fake):
    def fileno(self) -> int | None:
        return self.read_fd


def test_each_collector_fails_alone() -> None:
    sample, status = run_once(Registered(Fake()), 5.0)
    assert sample is not None and sample.values == {"n": 1} and status.ok
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
            start = time.monotonic()
            if poke:
                asyncio.get_running_loop().call_later(0.05, os.write, write_fd, b"x")
            await pause(collector, seconds)
            return time.monotonic() - start

        woken = WakeableFake(read_fd=read_fd)
        assert asyncio.run(timed(woken, 5.0, poke=True)) < 0.5
        os.read(read_fd, 16)
        assert 0.2 <= asyncio.run(timed(woken, 0.2, poke=False)) < 0.5
        assert 0.1 <= asyncio.run(timed(WakeableFake(), 0.1, poke=False)) < 0.4, "no fd yet"
        assert 0.1 <= asyncio.run(timed(Fake(), 0.1, poke=False)) < 0.4
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_close_all_releases_what_collectors_hold() -> None:
    fake = Fake()
    close_all([Registered(fake)])
    assert fake.closed


def test_summaries_for_heartbeats() -> None:
    telemetry = Telemetry()
    nvme = {"devices": {"nvme0n1": {"latency_us": 21.04}, "nvme1n1": {"latency_us": None}}}
    summarize(telemetry, Sample(collector="nvme", time=0, values=nvme))
    gpus = {"gpus": [{"index": 0, "temp_c": 61, "util_pct": 97, "mem_used_mb": 1024.0}]}
    summarize(telemetry, Sample(collector="gpu", time=0, values=gpus))
    summarize(telemetry, Sample(collector="clock", time=0, values={"offset_ms": -0.4}))
    assert telemetry.nvme_latency_us == {"nvme0n1": 21.0}
    assert telemetry.gpus == [GpuSample(index=0, temp_c=61, util_pct=97, mem_used_mb=1024.0)]
    assert telemetry.clock_offset_ms == -0.4


def test_health_follows_the_events() -> None:
    telemetry = Telemetry()
    health = Health(telemetry)
    failed = PreflightCheck(name="somaxconn", ok=False, value="4096", want=">= 65535")
    for event in (
        NodePreflight(ok=False, checks=[failed]),
        TopologyDegraded(gpu_a=0, gpu_b=1),
        NvmeLatencySpike(device="nvme0n1"),
        GpuThermal(gpu=3, level="warning"),
        GpuThermal(gpu=3, level="critical"),
        ClockDrift(),
        SpotNotice(provider="aws"),
    ):
        health.observe(event)
    assert not health.preflight_ok and not health.topology_ok
    assert telemetry.faults == [
        "clock.drift",
        "gpu.thermal:3:critical",
        "node.preflight:somaxconn",
        "nvme.latency_spike:nvme0n1",
        "spot.notice:aws",
        "topology.degraded:0-1",
    ]
    for event in (
        NodePreflight(ok=True, checks=[PreflightCheck(name="somaxconn", ok=True)]),
        TopologyDegraded(gpu_a=0, gpu_b=1, recovered=True),
        NvmeLatencyRecovered(device="nvme0n1"),
        GpuThermal(gpu=3, level="normal"),
        ClockDrift(recovered=True),
    ):
        health.observe(event)
    assert health.preflight_ok and health.topology_ok
    assert telemetry.faults == ["spot.notice:aws"]
