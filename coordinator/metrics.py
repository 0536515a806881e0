"""The coordinator's ``/metrics``: leadership on every coordinator; nodes, jobs and the
goodput ledger from the leader alone, built from its records at scrape time.

Cluster-wide series come only from the leader so that a ``sum`` over every coordinator
counts each job and node once; a standby reports ``ringmaster_coordinator_leader 0`` and
nothing else of the cluster. The one series updated as things happen is the event →
decision latency histogram: a latency exists only at the moment a decision is made.

Per-job series carry the training job's id as ``job_name`` (kube-state-metrics' name for a
Kubernetes Job): ``job`` is the label Prometheus gives every scrape target, and with the
default ``honor_labels: false`` an exported ``job`` would be renamed ``exported_job``. A
job that ended is shown for a retention (``--metrics-retention-s``) and then left out, so
a long-lived leader's exposition does not grow with every job it ever ran.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.election import Role
from coordinator.registry import NodeInfo
from proto.job import GOODPUT_BUCKETS, JobRecord, JobState
from proto.node import NodeState
from ringmaster.clock import SYSTEM, Clock

# From a healthy pause (tens of ms) to a decision stuck behind a stalled bus (seconds).
DECISION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Long enough for a dashboard to show how a job ended and for alerts on its last values to
# fire; short enough that a coordinator running thousands of jobs exports the live ones.
RETENTION_S = 3600.0
JOB_LABEL = "job_name"


class Leading(Protocol):
    """What the metrics read of the election (:class:`coordinator.election.Election`)."""

    role: Role
    epoch: int


class Nodes(Protocol):
    @property
    def nodes(self) -> Mapping[str, NodeInfo]: ...


class Jobs(Protocol):
    jobs: dict[str, JobRecord]


def decision_latency(registry: CollectorRegistry) -> Histogram:
    """Seconds from an event's ``time`` (stamped where it happened) to the end of the
    policy's handling of it on the leader: what an operator waits for after a fault."""
    return Histogram(
        "ringmaster_event_decision_seconds",
        "Time from an event's timestamp to the end of the leader's handling of it.",
        buckets=DECISION_BUCKETS,
        registry=registry,
    )


def registry_for(
    me: str,
    election: Leading,
    nodes: Nodes,
    jobs: Jobs,
    retention_s: float = RETENTION_S,
    clock: Clock = SYSTEM,
) -> CollectorRegistry:
    """A private registry (the global one would add the client's own process metrics).
    ``clock``: the one job records are stamped with (``finished_at``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CoordinatorCollector(me, election, nodes, jobs, retention_s, clock))
    return registry


class CoordinatorCollector(Collector):
    def __init__(
        self,
        me: str,
        election: Leading,
        nodes: Nodes,
        jobs: Jobs,
        retention_s: float,
        clock: Clock,
    ) -> None:
        self.me, self.election, self.nodes, self.jobs = me, election, nodes, jobs
        self.retention_s, self.clock = retention_s, clock

    def collect(self) -> Iterator[Metric]:
        leading = self.election.role is Role.LEADER
        leader = GaugeMetricFamily(
            "ringmaster_coordinator_leader",
            "Whether this coordinator holds the lease (1) or stands by (0).",
            labels=["coordinator"],
        )
        leader.add_metric([self.me], int(leading))
        epoch = GaugeMetricFamily(
            "ringmaster_coordinator_epoch",
            "The leader epoch this coordinator last held or saw (a KV revision).",
            labels=["coordinator"],
        )
        epoch.add_metric([self.me], self.election.epoch)
        yield from (leader, epoch)
        if leading:
            yield node_family(list(dict(self.nodes.nodes).values()))
            yield from job_families(
                retained(dict(self.jobs.jobs), self.retention_s, self.clock.time())
            )


def retained(jobs: Mapping[str, JobRecord], retention_s: float, now: float) -> dict[str, JobRecord]:
    """Every live job, and each ended one until ``retention_s`` after it ended."""
    return {
        job_id: job
        for job_id, job in jobs.items()
        if not job.state.terminal or (job.finished_at or job.updated_at) + retention_s > now
    }


def node_family(nodes: list[NodeInfo]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "ringmaster_nodes", "Nodes known to the leader, by state.", labels=["state"]
    )
    for state in NodeState:
        family.add_metric([state.value], sum(n.state is state for n in nodes))
    return family


def job_families(jobs: Mapping[str, JobRecord]) -> Iterator[Metric]:
    def gauge(name: str, documentation: str, *labels: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, documentation, labels=[JOB_LABEL, *labels])

    def counter(name: str, documentation: str, *labels: str) -> CounterMetricFamily:
        return CounterMetricFamily(name, documentation, labels=[JOB_LABEL, *labels])

    state = gauge(
        "ringmaster_job_state", "1 for the job's current state, 0 for the others.", "state"
    )
    step = gauge("ringmaster_job_step", "The newest step rank 0 reported.")
    target = gauge("ringmaster_job_target_steps", "The step at which the job completes.")
    world = gauge("ringmaster_job_world_size", "Ranks in the job's current attempt.")
    tokens = gauge("ringmaster_job_tokens_per_second", "Training throughput, all ranks together.")
    loss = gauge("ringmaster_job_loss", "The newest step's loss.")
    restarts = counter("ringmaster_job_restarts", "Relaunches after a fault.")
    pauses = counter("ringmaster_job_pauses", "Pauses at a step boundary.")
    goodput = counter(
        "ringmaster_job_goodput_gpu_seconds",
        "GPU-seconds of the job by goodput bucket (the ledger of coordinator.goodput).",
        "bucket",
    )
    for job_id, job in sorted(jobs.items()):
        for s in JobState:
            state.add_metric([job_id, s.value], int(job.state is s))
        step.add_metric([job_id], job.step)
        target.add_metric([job_id], job.target_steps)
        world.add_metric([job_id], job.world_size)
        if job.tokens_per_s is not None:
            tokens.add_metric([job_id], job.tokens_per_s)
        if job.loss is not None:
            loss.add_metric([job_id], job.loss)
        restarts.add_metric([job_id], job.restarts)
        pauses.add_metric([job_id], job.pauses)
        ledger = dict(job.goodput)
        for bucket in GOODPUT_BUCKETS:
            goodput.add_metric([job_id, bucket], ledger.get(bucket, 0.0))
    yield from (state, step, target, world, tokens, loss, restarts, pauses, goodput)
