"""Running collectors: one at a time per collector, each timed, each failing alone."""

from __future__ import annotations

import asyncio
import time

import structlog

from nodeagent.collectors.base import CollectorUnavailable, Sample
from nodeagent.registry import Registered
from proto.node import CollectorStatus, Telemetry

log = structlog.get_logger()


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


def summarize(telemetry: Telemetry, sample: Sample) -> None:
    """Fold the parts of a sample that heartbeats carry into ``telemetry``."""
    if sample.collector == "nvme":
        devices = sample.values.get("devices", {})
        telemetry.nvme_latency_us = {
            dev: round(v["latency_us"], 1)
            for dev, v in devices.items()
            if isinstance(v, dict) and v.get("latency_us") is not None
        }
