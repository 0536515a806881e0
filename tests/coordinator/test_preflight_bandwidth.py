"""The preflight bandwidth check's decision: rank 0's figures → slow nodes → a refusal and
an uncharged restart without them (coordinator/policy.py ``on_bandwidth``), and the job
manager publishing the figures and applying it."""

from __future__ import annotations

import pytest
from test_jobs import Cluster, rank0, spec

from coordinator import actions, progress_policy
from proto.api import SubmitJob
from proto.events import JobBandwidth, JobRecovering, NodeRefused
from proto.job import JobRecord, JobSection, JobSpec, JobState
from proto.progress import BandwidthChecked, StepDone, slow_nodes

NODES = ["node-0", "node-1", "node-2"]


def job(state: JobState = JobState.STARTING, ratio: float = 0.5) -> JobRecord:
    s = JobSpec(job=JobSection(name="t", nodes=3))
    s.policy.min_bandwidth_ratio = ratio
    return JobRecord(id="t-1", name="t", spec=s, state=state, nodes=NODES, world_size=3)


def checked(**gbps: float) -> BandwidthChecked:
    figures = {node.replace("_", "-"): value for node, value in gbps.items()}
    return BandwidthChecked(job="t-1", node_gbps=figures, median_gbps=6.1)


def test_a_node_under_the_ratio_of_its_peers_median_is_slow() -> None:
    assert slow_nodes({"a": 0.8, "b": 6.0, "c": 6.2}, 0.5) == {"a": 6.1}
    assert slow_nodes({"a": 3.1, "b": 6.0, "c": 6.2}, 0.5) == {}
    # two nodes share their one link's figure: neither can be singled out
    assert slow_nodes({"a": 0.8, "b": 0.8}, 0.5) == {}
    assert slow_nodes({"a": 0.8}, 0.5) == {}


def test_a_slow_node_is_refused_with_its_figure_and_the_restart_is_not_charged() -> None:
    decided = progress_policy.on_bandwidth(job(), checked(node_0=6.0, node_1=0.8, node_2=6.2))
    why = "node-1 bus bandwidth 0.8 GB/s, under 0.5 × the median 6.1 GB/s of its peers"
    assert decided == [
        actions.RefuseNode("node-1", why),
        actions.RestartJob(why, ("node-1",)),  # failure None: uncharged
    ]


def test_nodes_within_the_ratio_proceed_unchanged() -> None:
    assert progress_policy.on_bandwidth(job(), checked(node_0=6.0, node_1=4.0, node_2=6.2)) == []
    strict = job(ratio=0.9)
    assert [
        type(a) for a in progress_policy.on_bandwidth(strict, checked(node_0=6, node_1=4, node_2=6))
    ] == [
        actions.RefuseNode,
        actions.RestartJob,
    ]


def test_figures_after_the_start_or_for_other_nodes_change_nothing() -> None:
    slow = checked(node_0=6.0, node_1=0.8, node_2=6.2)
    assert progress_policy.on_bandwidth(job(JobState.RUNNING), slow) == []
    assert progress_policy.on_bandwidth(job(JobState.RECOVERING), slow) == []
    elsewhere = checked(node_0=6.0, node_5=0.8, node_2=6.2)
    assert progress_policy.on_bandwidth(job(), elsewhere) == []


@pytest.mark.anyio
async def test_the_manager_publishes_the_figures_refuses_and_restarts_without_the_node() -> None:
    c = Cluster(nodes=4)
    m = c.leader()
    reply = await m.submit(SubmitJob(spec=spec(3), workdir="/w"))
    job = m.jobs[reply.job]
    await m.start_pending(job)
    assert job.nodes == NODES and job.state is JobState.STARTING
    figures = {"node-0": 6.0, "node-1": 0.8, "node-2": 6.2}
    await rank0(m, BandwidthChecked(job=job.id, node_gbps=figures, median_gbps=6.0))
    [bw] = [e for e in c.events if isinstance(e, JobBandwidth)]
    assert bw.node_gbps == figures and bw.slow == ["node-1"]
    [refused] = [e for e in c.events if isinstance(e, NodeRefused)]
    assert refused.node == "node-1" and "0.8 GB/s" in refused.reason
    assert isinstance(c.events[-1], JobRecovering)
    stored = await c.stored(job.id)
    assert stored.state is JobState.RECOVERING and stored.restarts == 0
    assert list(stored.excluded) == ["node-1"]
    await m.settle()
    await m.start_pending(job)
    assert job.nodes == ["node-0", "node-2", "node-3"] and job.state is JobState.STARTING


@pytest.mark.anyio
async def test_the_manager_lets_a_job_within_the_ratio_run() -> None:
    c = Cluster()
    m = c.leader()
    reply = await m.submit(SubmitJob(spec=spec(3), workdir="/w"))
    job = m.jobs[reply.job]
    await m.start_pending(job)
    figures = {"node-0": 6.0, "node-1": 5.0, "node-2": 6.2}
    await rank0(m, BandwidthChecked(job=job.id, node_gbps=figures, median_gbps=6.0))
    [bw] = [e for e in c.events if isinstance(e, JobBandwidth)]
    assert bw.slow == [] and "node-1 5.0" in bw.message
    assert not [e for e in c.events if isinstance(e, NodeRefused)]
    await rank0(m, StepDone(job=job.id, step=1, loss=5.0))
    assert job.state is JobState.RUNNING and job.restarts == 0
