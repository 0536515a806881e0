"""Known daemon state for the metrics tests: an agent and a leading coordinator with every
kind of series present, and what their registries expose, parsed the way Prometheus does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from coordinator import metrics as coordinator_metrics
from coordinator.election import Role
from coordinator.registry import NodeInfo
from nodeagent import metrics as agent_metrics
from nodeagent.collectors.base import Sample
from nodeagent.collectors.clock import ClockSample
from nodeagent.collectors.gpu import GpuHealthSample, GpuIdentity, GpuReading
from nodeagent.collectors.nvme import NvmeDeviceReading, NvmeLatencySample
from nodeagent.sampling import ActiveConditions
from proto.conditions import Condition, ConditionKind, Severity
from proto.job import JobRecord, JobSection, JobSpec, JobState
from proto.node import CollectorStatus, NodeState

H100 = GpuIdentity(
    name="NVIDIA H100", uuid="GPU-0", bus_id="0000:01:00.0", slowdown_c=90.0, shutdown_c=95.0
)


@dataclass
class FakeAgent:
    node: str = "node-7"
    latest: dict[str, Sample] = field(default_factory=dict)
    statuses: dict[str, CollectorStatus] = field(default_factory=dict)
    active: ActiveConditions = field(default_factory=ActiveConditions)
    beats_sent: int = 0


def agent() -> FakeAgent:
    """Two GPUs (one hot and slowed, one that cannot say why its clocks moved), one lost;
    two NVMe devices (one slow, one idle and read-only); a clock 2.5 ms ahead; an open
    NVMe latency condition; a failing collector."""
    gpus = GpuHealthSample(
        time=1000.0,
        gpus=[
            GpuReading(
                index=0,
                identity=H100,
                temp_c=91.0,
                clock_reasons=["sw_thermal_slowdown", "hw_thermal_slowdown"],
                pcie_tx_gbps=12.5,
                pcie_rx_gbps=3.25,
                pcie_replay=17,
                util_pct=87.0,
                mem_used_mb=1024.0,
                mem_total_mb=81559.0,
            ),
            GpuReading(index=1, identity=H100, temp_c=40.0),
        ],
        lost=[2],
    )
    nvme = NvmeLatencySample(
        time=1000.5,
        devices={
            "nvme0n1": NvmeDeviceReading(readonly=False, in_flight=3, latency_us=405.0),
            "nvme1n1": NvmeDeviceReading(readonly=True, in_flight=0, idle=True),
        },
    )
    clock = ClockSample(time=999.0, offset_ms=2.5, bound_ms=0.1, source="peer", synced=True)
    state = FakeAgent(
        latest={"gpu": gpus, "nvme": nvme, "clock": clock},
        statuses={
            "gpu": CollectorStatus(name="gpu", ok=True, duration_s=0.002),
            "nvme": CollectorStatus(name="nvme", ok=True, duration_s=0.0001),
            "clock": CollectorStatus(name="clock", ok=True, duration_s=0.25),
            "preemption": CollectorStatus(name="preemption", ok=False, error="unavailable: x"),
        },
        beats_sent=42,
    )
    state.active.apply(
        Condition(
            kind=ConditionKind.NVME_LATENCY,
            node="node-7",
            subject="nvme0n1",
            severity=Severity.WARNING,
        )
    )
    return state


@dataclass
class FakeElection:
    role: Role = Role.LEADER
    epoch: int = 12


@dataclass
class FakeNodes:
    nodes: dict[str, NodeInfo] = field(default_factory=dict)


@dataclass
class FakeJobs:
    jobs: dict[str, JobRecord] = field(default_factory=dict)


def job(job_id: str, state: JobState, **fields: Any) -> JobRecord:
    spec = JobSpec(job=JobSection(name=job_id.split("-")[0]))
    return JobRecord(id=job_id, name=spec.job.name, spec=spec, state=state, **fields)


def coordinator(
    role: Role = Role.LEADER,
) -> tuple[CollectorRegistry, FakeElection, FakeNodes, FakeJobs]:
    """A coordinator with three nodes (ready, degraded, lost) and two jobs, one running
    with a goodput ledger and one pending with no figures yet."""
    election = FakeElection(role=role)
    nodes = FakeNodes(
        {
            "a": NodeInfo(id="a"),
            "b": NodeInfo(id="b", state=NodeState.DEGRADED),
            "c": NodeInfo(id="c", state=NodeState.LOST),
        }
    )
    jobs = FakeJobs(
        {
            "tiny-1": job(
                "tiny-1",
                JobState.RUNNING,
                step=120,
                target_steps=200,
                world_size=2,
                tokens_per_s=5120.0,
                loss=3.25,
                restarts=1,
                pauses=2,
                goodput={"productive": 300.0, "startup": 20.0, "paused": 8.5},
            ),
            "tiny-2": job("tiny-2", JobState.PENDING),
        }
    )
    registry = coordinator_metrics.registry_for("coordinator-0", election, nodes, jobs)
    latency = coordinator_metrics.decision_latency(registry)
    latency.observe(0.03)
    latency.observe(0.2)
    return registry, election, nodes, jobs


def agent_registry(state: FakeAgent | None = None) -> CollectorRegistry:
    return agent_metrics.registry_for(state or agent())


def families(registry: CollectorRegistry) -> dict[str, Metric]:
    """The exposition as Prometheus reads it, by family name."""
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(family: Metric, **labels: str) -> float:
    """The one sample of ``family`` with exactly these labels."""
    [found] = [s.value for s in family.samples if s.labels == labels]
    return found


def series_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry exposes (``_total``, ``_bucket`` included)."""
    return {s.name for f in families(registry).values() for s in f.samples}
