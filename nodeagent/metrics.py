"""The agent's ``/metrics``: built from its own state at scrape time, node_exporter style.

Nothing is updated as the agent runs: the collector below reads the newest sample of each
hardware collector, the collectors' statuses, the open conditions and the heartbeat count
when Prometheus asks, so a metric can never disagree with what the heartbeat carries.
Names follow Prometheus' conventions: base units (µs and ms become seconds, MB bytes,
GB/s bytes per second, percentages ratios), ``_total`` on counters, and a ``node`` label on
every series so that dashboards need no relabelling.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nodeagent.collectors.base import Sample
from nodeagent.collectors.clock import ClockSample
from nodeagent.collectors.gpu import CLOCK_REASONS, GpuHealthSample, GpuReading
from nodeagent.collectors.nvme import NvmeLatencySample
from nodeagent.sampling import ActiveConditions
from proto.node import CollectorStatus

MB = 1 << 20  # the GPU collector's MB are MiB (NVML's bytes ÷ 2²⁰)


class AgentState(Protocol):
    """What the metrics read of the agent (:class:`nodeagent.daemon.Agent`)."""

    node: str
    latest: dict[str, Sample]  # the newest successful sample, by collector name
    statuses: dict[str, CollectorStatus]
    active: ActiveConditions
    beats_sent: int


def registry_for(agent: AgentState) -> CollectorRegistry:
    """A private registry (not prometheus-client's global one, which would also export the
    client's own process metrics under names we do not control)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    return registry


class AgentCollector(Collector):
    def __init__(self, agent: AgentState) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        agent, node = self.agent, self.agent.node
        latest = dict(agent.latest)  # one copy in one call: the loop replaces entries
        for sample in latest.values():
            if isinstance(sample, GpuHealthSample):
                yield from gpu_families(node, sample)
            elif isinstance(sample, NvmeLatencySample):
                yield from nvme_families(node, sample)
            elif isinstance(sample, ClockSample):
                yield from clock_families(node, sample)
        succeeded_at = {name: sample.time for name, sample in latest.items()}
        yield from collector_families(node, list(dict(agent.statuses).values()), succeeded_at)
        yield condition_family(node, agent.active)
        beats = CounterMetricFamily(
            "ringmaster_heartbeats_sent", "Heartbeats this agent has published.", labels=["node"]
        )
        beats.add_metric([node], agent.beats_sent)
        yield beats


def _gauge(name: str, documentation: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=["node", *labels])


class GpuFamilies:
    """Every per-GPU family, filled one GPU at a time."""

    def __init__(self) -> None:
        self.info = _gauge(
            "ringmaster_gpu_info", "A GPU on the bus (value 1).", "gpu", "name", "uuid"
        )
        self.temp = _gauge("ringmaster_gpu_temperature_celsius", "GPU core temperature.", "gpu")
        self.util = _gauge(
            "ringmaster_gpu_utilization_ratio", "Fraction of time a kernel ran (0-1).", "gpu"
        )
        self.used = _gauge("ringmaster_gpu_memory_used_bytes", "GPU memory in use.", "gpu")
        self.total = _gauge("ringmaster_gpu_memory_total_bytes", "GPU memory installed.", "gpu")
        self.reason = _gauge(
            "ringmaster_gpu_clock_event_reason",
            "Whether a clock-event (throttle) reason is active (1) or not (0).",
            "gpu",
            "reason",
        )
        self.pcie = _gauge(
            "ringmaster_gpu_pcie_throughput_bytes_per_second",
            "PCIe throughput over NVML's last 20 ms window, by direction (tx, rx).",
            "gpu",
            "direction",
        )
        self.replays = CounterMetricFamily(
            "ringmaster_gpu_pcie_replays",
            "PCIe replays on the GPU's link since the driver loaded.",
            labels=["node", "gpu"],
        )
        self.lost = _gauge("ringmaster_gpu_lost", "A GPU that fell off the bus (value 1).", "gpu")

    def add(self, node: str, g: GpuReading) -> None:
        """One GPU's series; a metric its driver cannot read is left out, never shown as 0."""
        gpu = str(g.index)
        self.info.add_metric([node, gpu, g.identity.name, g.identity.uuid], 1)
        scaled = (
            (self.temp, g.temp_c, 1.0),
            (self.util, g.util_pct, 0.01),
            (self.used, g.mem_used_mb, MB),
            (self.total, g.mem_total_mb, MB),
        )
        for family, value, scale in scaled:
            if value is not None:
                family.add_metric([node, gpu], value * scale)
        if g.clock_reasons is not None:
            for name in CLOCK_REASONS.values():
                self.reason.add_metric([node, gpu, name], int(name in g.clock_reasons))
        for direction, gbps in (("tx", g.pcie_tx_gbps), ("rx", g.pcie_rx_gbps)):
            if gbps is not None:
                self.pcie.add_metric([node, gpu, direction], gbps * 1e9)
        if g.pcie_replay is not None:
            self.replays.add_metric([node, gpu], g.pcie_replay)

    def __iter__(self) -> Iterator[Metric]:
        yield from (self.info, self.temp, self.util, self.used, self.total, self.reason)
        yield from (self.pcie, self.replays, self.lost)


def gpu_families(node: str, sample: GpuHealthSample) -> Iterator[Metric]:
    families = GpuFamilies()
    for g in sample.gpus:
        families.add(node, g)
    for index in sample.lost:
        families.lost.add_metric([node, str(index)], 1)
    yield from families


def nvme_families(node: str, sample: NvmeLatencySample) -> Iterator[Metric]:
    latency = _gauge(
        "ringmaster_nvme_latency_seconds",
        "Mean completion latency over the last window (absent while idle).",
        "device",
    )
    readonly = _gauge(
        "ringmaster_nvme_readonly", "The kernel's read-only flag for the device (0/1).", "device"
    )
    in_flight = _gauge("ringmaster_nvme_in_flight_ios", "I/Os in flight on the device.", "device")
    for device, r in sorted(sample.devices.items()):
        if r.latency_us is not None:
            latency.add_metric([node, device], r.latency_us / 1e6)
        readonly.add_metric([node, device], int(r.readonly))
        in_flight.add_metric([node, device], r.in_flight)
    yield from (latency, readonly, in_flight)


def clock_families(node: str, sample: ClockSample) -> Iterator[Metric]:
    offset = _gauge(
        "ringmaster_clock_offset_seconds",
        "This node's clock minus the reference (positive: ahead), from the best source.",
    )
    synced = _gauge(
        "ringmaster_clock_synchronized", "Neither the kernel nor chrony says unsynchronised."
    )
    if sample.offset_ms is not None:
        offset.add_metric([node], sample.offset_ms / 1e3)
    synced.add_metric([node], int(sample.synced))
    yield from (offset, synced)


def collector_families(
    node: str, statuses: list[CollectorStatus], succeeded_at: dict[str, float]
) -> Iterator[Metric]:
    up = _gauge(
        "ringmaster_collector_up", "Whether the collector's last run succeeded.", "collector"
    )
    duration = _gauge(
        "ringmaster_collector_duration_seconds", "How long the last run took.", "collector"
    )
    success = _gauge(
        "ringmaster_collector_last_success_timestamp_seconds",
        "When the collector last read its source (Unix time).",
        "collector",
    )
    for status in sorted(statuses, key=lambda s: s.name):
        up.add_metric([node, status.name], int(status.ok))
        duration.add_metric([node, status.name], status.duration_s)
        if status.name in succeeded_at:
            success.add_metric([node, status.name], succeeded_at[status.name])
    yield from (up, duration, success)


def condition_family(node: str, active: ActiveConditions) -> GaugeMetricFamily:
    family = _gauge(
        "ringmaster_node_condition",
        "An open condition on this node (value 1); closed ones disappear.",
        "kind",
        "subject",
        "severity",
    )
    for c in active.conditions():
        family.add_metric([node, c.kind.value, c.subject, c.severity.value], 1)
    return family
