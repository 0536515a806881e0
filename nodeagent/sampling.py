"""Running collectors: one at a time per collector, each timed, each failing alone; and
what heartbeats carry, folded from samples (telemetry) and from events (conditions).

A sample is stamped with the ``now`` it is given (the agent's clock: detectors judge holds
and windows on it); how long a collector took is its real duration, measured here."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, TypeVar

import structlog

from nodeagent.collectors.base import Closable, Collector, CollectorUnavailable, Sample, Wakeable
from nodeagent.collectors.clock import ClockSample
from nodeagent.collectors.gpu import GpuHealthSample
from nodeagent.collectors.nvme import NvmeLatencySample
from nodeagent.registry import Registered
from proto.conditions import Condition
from proto.events import EventBase
from proto.node import CollectorStatus, GpuSample, Telemetry

log = structlog.get_logger()
WAKE_GAP_S = 0.005  # after a wake-up, so a source that stays readable cannot spin the loop
S = TypeVar("S", bound=Sample)


def run_once(entry: Registered[S], now: float) -> tuple[S | None, CollectorStatus]:
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


async def run_once_async(entry: Registered[S], now: float) -> tuple[S | None, CollectorStatus]:
    return await asyncio.to_thread(run_once, entry, now)


async def pause(collector: Collector[Sample], seconds: float) -> None:
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


def close_all(entries: list[Registered[Any]]) -> None:
    for entry in entries:
        if isinstance(entry.collector, Closable):
            entry.collector.close()


def summarize(telemetry: Telemetry, sample: Sample) -> None:
    """Fold the parts of a sample that heartbeats carry into ``telemetry``."""
    match sample:
        case NvmeLatencySample(devices=devices):
            telemetry.nvme_latency_us = {
                dev: round(r.latency_us, 1)
                for dev, r in devices.items()
                if r.latency_us is not None
            }
        case GpuHealthSample(gpus=gpus):
            telemetry.gpus = tuple(
                GpuSample(
                    index=g.index, temp_c=g.temp_c, util_pct=g.util_pct, mem_used_mb=g.mem_used_mb
                )
                for g in gpus
            )
        case ClockSample(offset_ms=offset):
            telemetry.clock_offset_ms = offset


class ActiveConditions:
    """The node's open conditions, by key: what each heartbeat carries as the authoritative
    set. Detectors' latches decide; this only follows the conditions their events (and the
    few changes no event announces) carry."""

    def __init__(self) -> None:
        self._open: dict[str, Condition] = {}

    def observe(self, event: EventBase) -> None:
        if event.condition is not None:
            self.apply(event.condition)

    def apply(self, condition: Condition) -> None:
        if condition.active:
            self._open[condition.key] = condition
        else:
            self._open.pop(condition.key, None)

    def conditions(self) -> list[Condition]:
        """Every open condition, in key order. One copy of the items in one call: the
        metrics endpoint reads this from its own thread while the loop opens and closes."""
        return [condition for _, condition in sorted(self._open.items())]
