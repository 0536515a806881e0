"""Running collectors: one at a time per collector, each timed, each failing alone; and
what heartbeats carry, folded from samples (telemetry) and from events (health)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import structlog

from nodeagent.collectors.base import Closable, Collector, CollectorUnavailable, Sample, Wakeable
from nodeagent.registry import Registered
from proto.events import (
    ClockDrift,
    EventBase,
    GpuThermal,
    NodePreflight,
    NvmeLatencyRecovered,
    NvmeLatencySpike,
    NvmeReadonly,
    PcieDegraded,
    SpotNotice,
    TopologyDegraded,
)
from proto.node import CollectorStatus, GpuSample, Telemetry

log = structlog.get_logger()
WAKE_GAP_S = 0.005  # after a wake-up, so a source that stays readable cannot spin the loop


def run_once(entry: Registered, now: float) -> tuple[Sample | None, CollectorStatus]:
    """Call one collector; never raises. The status says what happened and how long."""
    name = entry.collector.name
    start = time.perf_counter()
    try:
        sample = entry.collector.collect(now)
    except CollectorUnavailable as exc:
        return None, CollectorStatus(
            name=name, ok=False, duration_s=time.perf_counter() - start, error=f"unavailable: {exc}"
        )
    except Exception as exc:  # one collector's bug must not take the daemon down
        log.warning("collector failed", collector=name, error=repr(exc))
        return None, CollectorStatus(
            name=name, ok=False, duration_s=time.perf_counter() - start, error=repr(exc)
        )
    return sample, CollectorStatus(name=name, ok=True, duration_s=time.perf_counter() - start)


async def run_once_async(entry: Registered) -> tuple[Sample | None, CollectorStatus]:
    return await asyncio.to_thread(run_once, entry, time.time())


async def pause(collector: Collector, seconds: float) -> None:
    """Wait ``seconds`` before the next collection, or less if the collector is
    :class:`Wakeable` and its source has news."""
    fd = collector.fileno() if isinstance(collector, Wakeable) else None
    if fd is None:
        await asyncio.sleep(seconds)
        return
    loop = asyncio.get_running_loop()
    news = asyncio.Event()
    loop.add_reader(fd, news.set)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(news.wait(), seconds)
    finally:
        loop.remove_reader(fd)
    if news.is_set():
        await asyncio.sleep(WAKE_GAP_S)


def close_all(entries: list[Registered]) -> None:
    for entry in entries:
        if isinstance(entry.collector, Closable):
            entry.collector.close()


def summarize(telemetry: Telemetry, sample: Sample) -> None:
    """Fold the parts of a sample that heartbeats carry into ``telemetry``."""
    values = sample.values
    if sample.collector == "nvme":
        devices = values.get("devices", {})
        telemetry.nvme_latency_us = {
            dev: round(v["latency_us"], 1)
            for dev, v in devices.items()
            if isinstance(v, dict) and v.get("latency_us") is not None
        }
    elif sample.collector == "gpu":
        telemetry.gpus = [
            GpuSample(
                index=g["index"],
                temp_c=g.get("temp_c"),
                util_pct=g.get("util_pct"),
                mem_used_mb=g.get("mem_used_mb"),
            )
            for g in values.get("gpus", [])
        ]
    elif sample.collector == "clock":
        telemetry.clock_offset_ms = values.get("offset_ms")


@dataclass
class Health:
    """What the node's own events say is wrong now: the heartbeat's ``preflight_ok`` and
    ``topology_ok``, and its telemetry's ``faults`` (``kind:subject`` strings)."""

    telemetry: Telemetry
    preflight_ok: bool = True
    _active: dict[str, bool] = field(default_factory=dict)

    @property
    def topology_ok(self) -> bool:
        return not any(key.startswith("topology.degraded:") for key in self._active)

    def observe(self, event: EventBase) -> None:
        match event:
            case NodePreflight(ok=ok, checks=checks):
                self.preflight_ok = ok
                for check in checks:
                    self._set(f"node.preflight:{check.name}", not check.ok)
            case TopologyDegraded(gpu_a=a, gpu_b=b, recovered=recovered):
                self._set(f"topology.degraded:{a}-{b}", not recovered)
            case NvmeLatencySpike(device=dev):
                self._set(f"nvme.latency_spike:{dev}", True)
            case NvmeLatencyRecovered(device=dev):
                self._set(f"nvme.latency_spike:{dev}", False)
            case NvmeReadonly(device=dev, readonly=readonly):
                self._set(f"nvme.readonly:{dev}", readonly)
            case GpuThermal(gpu=gpu, level=level):
                for name in ("warning", "critical"):
                    self._set(f"gpu.thermal:{gpu}:{name}", level == name)
            case PcieDegraded(gpu=gpu, recovered=recovered):
                self._set(f"pcie.degraded:{gpu}", not recovered)
            case ClockDrift(recovered=recovered):
                self._set("clock.drift", not recovered)
            case SpotNotice(provider=provider):
                self._set(f"spot.notice:{provider}", True)
        self.telemetry.faults = sorted(self._active)

    def _set(self, key: str, active: bool) -> None:
        if active:
            self._active[key] = True
        else:
            self._active.pop(key, None)
