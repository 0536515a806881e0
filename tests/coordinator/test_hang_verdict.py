"""A hang no node can pin on a rank of its own waits for the network's word before its
verdict (coordinator.hang_verdict), and a job that makes no step while the network cuts
one of its nodes off is restarted without it whatever was decided before
(network_culprit.stalled_cut_off)."""

from __future__ import annotations

import pytest
from test_job_recovery import launched
from test_jobs import Cluster, rank0
from test_policy_network import cannot_reach

from coordinator import hang_verdict
from coordinator.jobs import JobManager
from proto.conditions import Severity, condition_key
from proto.events import WorkerHung
from proto.job import JobRecord, JobState
from proto.progress import StepDone

pytestmark = pytest.mark.anyio


def waiting(job: JobRecord, node: str = "node-0") -> WorkerHung:
    return WorkerHung(
        node=node,
        job=job.id,
        rank=job.nodes.index(node),
        attempt=job.attempt,
        step=5,
        severity=Severity.CRITICAL,
        evidence="culprit unknown: every stalled rank on this node waits in a collective",
        culprit_unknown=True,
    )


CONFIRM_S = 5.0  # how long the nodes' probes take to find a peer unreachable


def probing(c: Cluster, confirm_s: float = CONFIRM_S) -> None:
    for node in c.registry.nodes.values():
        node.probe_confirm_s = confirm_s


def cut_off(c: Cluster, node: str, job: JobRecord) -> None:
    """Every other node of the job says it cannot reach ``node``."""
    for reporter in job.nodes:
        if reporter != node:
            cond = cannot_reach(reporter, node)
            c.registry.nodes[reporter].conditions[condition_key(cond)] = cond


async def three_nodes(c: Cluster, m: JobManager) -> JobRecord:
    job = await launched(c, m, nodes=3)
    assert job.nodes == ["node-0", "node-1", "node-2"]
    return job


async def test_a_hang_without_a_culprit_waits_for_the_probes_and_leaves_out_the_cut_off_node() -> (
    None
):
    c = Cluster(nodes=4)
    m = c.leader()
    job = await three_nodes(c, m)
    probing(c)
    await m.on_event(waiting(job))
    assert job.state is JobState.RUNNING and job.restarts == 0  # the verdict waits
    await m.tick()
    assert job.state is JobState.RUNNING
    cut_off(c, "node-2", job)  # the peers' probes confirm the partition
    await m.tick()
    assert job.state is JobState.RECOVERING and job.restarts == 1
    assert list(job.excluded) == ["node-2"]
    assert "node-2: unreachable from node-0" in job.reason


async def test_a_new_leader_gives_the_verdict_its_predecessor_held() -> None:
    c = Cluster(nodes=4)
    old = c.leader()
    job = await three_nodes(c, old)
    probing(c)
    await old.on_event(waiting(job))
    await old.flush()
    assert (await c.stored(job.id)).held_hang is not None
    new = c.leader("c-1", epoch=2)  # the old leader dies before the probes confirm
    await new.load()
    cut_off(c, "node-2", job)
    await new.tick()
    moved = new.jobs[job.id]
    assert moved.state is JobState.RECOVERING and list(moved.excluded) == ["node-2"]
    assert moved.held_hang is None


async def test_without_the_networks_word_the_wait_ends_in_a_plain_restart() -> None:
    c = Cluster(nodes=4)
    m = c.leader()
    job = await three_nodes(c, m)
    probing(c)
    await m.on_event(waiting(job))
    await m.tick()
    assert job.state is JobState.RUNNING  # the probes may still speak
    c.clock.advance(CONFIRM_S + hang_verdict.SLACK_S)  # they did not
    await m.tick()
    assert job.state is JobState.RECOVERING and job.restarts == 1
    assert not job.excluded  # no node blamed without evidence


async def test_a_job_that_steps_past_a_held_hang_was_slow_and_is_not_restarted() -> None:
    """A loaded machine stretches one step past the floor: every rank looks stalled in a
    collective, then the step completes. The nodes' newest word wins over the held one."""
    c = Cluster(nodes=4)
    m = c.leader()
    job = await three_nodes(c, m)
    probing(c)
    await rank0(m, StepDone(job=job.id, step=5))
    await m.on_event(waiting(job))  # hung after step 5
    assert job.held_hang is not None
    await rank0(m, StepDone(job=job.id, step=6))
    c.clock.advance(CONFIRM_S + hang_verdict.SLACK_S)  # the wait is over
    await m.tick()
    assert job.state is JobState.RUNNING and job.restarts == 0, job.reason
    assert job.held_hang is None


async def test_with_the_networks_word_in_or_no_probes_a_hang_is_decided_at_once() -> None:
    c = Cluster(nodes=4)
    m = c.leader()
    job = await three_nodes(c, m)
    probing(c)
    cut_off(c, "node-2", job)
    await m.on_event(waiting(job))
    assert job.state is JobState.RECOVERING and list(job.excluded) == ["node-2"]
    c2 = Cluster(nodes=4)
    m2 = c2.leader()
    plain = await three_nodes(c2, m2)  # agents that probe no peer (probe_confirm_s 0)
    await m2.on_event(waiting(plain))
    assert plain.state is JobState.RECOVERING and not plain.excluded


async def test_a_start_stuck_with_a_cut_off_node_is_restarted_without_it() -> None:
    """Level-triggered: the restart before the network's word kept node-2, and the next
    attempt waits on a rendezvous node-2 cannot reach."""
    c = Cluster(nodes=4)
    m = c.leader()
    job = await three_nodes(c, m)
    job.state = JobState.STARTING  # the attempt started, no step yet
    job.attempt_started_at = c.clock.time()
    cut_off(c, "node-2", job)
    await m.tick()
    assert job.state is JobState.STARTING  # not stalled for the threshold yet
    c.clock.advance(60.0)
    await m.tick()
    assert job.state is JobState.RECOVERING and list(job.excluded) == ["node-2"]
    assert "no step for 60 s with a node cut off from its peers" in job.reason


async def test_a_job_that_steps_is_left_alone_whatever_the_probes_say() -> None:
    c = Cluster(nodes=4)
    m = c.leader()
    job = await three_nodes(c, m)
    cut_off(c, "node-2", job)
    c.clock.advance(60.0)  # a minute into the attempt ...
    job.last_step_at = c.clock.time()  # ... its newest step just now
    await m.tick()
    assert job.state is JobState.RUNNING and job.restarts == 0
