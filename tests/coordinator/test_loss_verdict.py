"""The verdict on a silent node of a job whose steps are slow waits for one beat of its
peers late enough to show whether the ranks step on (coordinator.loss_verdict): kept when
they do, restarted when they do not or when the peers stay silent too."""

from __future__ import annotations

import msgspec
import pytest
from test_job_recovery import launched
from test_jobs import Cluster, rank0, spec

from coordinator import loss_verdict
from coordinator.jobs import JobManager
from coordinator.loss_verdict import AwaitedVerdicts, evidence_at
from proto.events import NodeAway
from proto.job import JobRecord, JobState
from proto.node import NodeState, RankReport
from proto.progress import StepDone

pytestmark = pytest.mark.anyio


async def slow_job_loses_rank_0s_node(c: Cluster, m: JobManager) -> JobRecord:
    """Half a second a step, rank 0's newest word just in: node-0 falls silent before
    its peer could show two more steps."""
    job = await launched(c, m)
    job.step_s = 0.5
    await rank0(m, StepDone(job=job.id, step=9, loss=4.0))
    c.registry.nodes["node-0"].state = NodeState.AWAY  # as the leader's sweep marks it
    await m.on_event(NodeAway(node="node-0"))
    assert job.state is JobState.RUNNING and job.restarts == 0  # the verdict waits
    await m.tick()
    assert job.state is JobState.RUNNING  # ... for the peer's next beat
    return job


def peer_reports(c: Cluster, job: JobRecord, last_step: int, beat_later: bool) -> None:
    peer = c.registry.nodes["node-1"]
    report = RankReport(job=job.id, rank=1, attempt=job.attempt, pid=1, alive=True)
    peer.ranks = [msgspec.structs.replace(report, last_step=last_step)]
    if beat_later:  # a beat that arrived after the steps were due
        c.clock.advance(5.0)
        peer.last_seen = peer.beat_seen = c.clock.monotonic()


async def test_the_peer_stepping_on_keeps_the_silent_node() -> None:
    c = Cluster()
    m = c.leader()
    job = await slow_job_loses_rank_0s_node(c, m)
    peer_reports(c, job, last_step=job.step + 2, beat_later=False)
    await m.tick()
    peer_reports(c, job, last_step=job.step + 1, beat_later=True)  # nothing waits anymore
    await m.tick()
    assert job.state is JobState.RUNNING and job.restarts == 0


async def test_a_peer_stuck_in_its_beat_after_the_steps_were_due_restarts_the_job() -> None:
    c = Cluster()
    m = c.leader()
    job = await slow_job_loses_rank_0s_node(c, m)
    peer_reports(c, job, last_step=job.step + 1, beat_later=False)
    await m.tick()
    assert job.state is JobState.RUNNING  # that beat is older than the steps' due time
    peer_reports(c, job, last_step=job.step + 1, beat_later=True)
    await m.tick()
    assert job.state is JobState.RECOVERING and job.restarts == 1
    assert list(job.excluded) == ["node-0"]


async def test_a_bus_outage_ending_is_no_beat_of_the_peers() -> None:
    """The bus comes back (every node's silence clock starts afresh): that is no beat of
    the peer's, so it cannot show whether the ranks stepped on; the verdict still waits."""
    c = Cluster()
    m = c.leader()
    job = await slow_job_loses_rank_0s_node(c, m)
    c.registry.bus_alive(c.clock.monotonic())
    c.clock.advance(5.0)
    c.registry.bus_alive(c.clock.monotonic())  # the canary back after 5 s away
    await m.tick()
    assert job.state is JobState.RUNNING and job.restarts == 0


async def test_peers_silent_too_end_the_wait_after_its_bound() -> None:
    c = Cluster()
    m = c.leader()
    job = await launched(c, m)
    job.step_s = 0.5
    await rank0(m, StepDone(job=job.id, step=9, loss=4.0))
    c.registry.nodes["node-0"].state = NodeState.AWAY
    await m.on_event(NodeAway(node="node-0"))
    c.clock.advance(loss_verdict.MAX_WAIT_S)
    await m.tick()
    assert job.state is JobState.RECOVERING and job.restarts == 1


async def test_a_silent_node_that_beats_again_during_the_wait_is_no_loss() -> None:
    c = Cluster()
    m = c.leader()
    job = await slow_job_loses_rank_0s_node(c, m)
    c.beat("node-0")  # its agent is back before the peers' beat came
    peer_reports(c, job, last_step=job.step + 1, beat_later=True)
    await m.tick()
    assert job.state is JobState.RUNNING and job.restarts == 0


def test_the_evidence_is_due_two_steps_and_a_beat_file_after_rank_0s_word() -> None:
    assert evidence_at(None, 0.5) is None and evidence_at(100.0, None) is None
    due = evidence_at(100.0, 0.5)
    assert due is not None and 101.0 + 0.5 < due < 101.0 + 0.5 + 1.0


def test_a_verdict_for_an_attempt_that_ended_is_dropped() -> None:
    job = JobRecord(id="j", name="j", spec=spec(2), attempt=1, state=JobState.RUNNING)
    awaited = AwaitedVerdicts()
    awaited.wait(job, NodeAway(node="node-0"), due=10.0, now=0.0)
    job.attempt = 2  # restarted meanwhile for another reason
    assert awaited.ready({"j": job}, now=100.0, decidable=lambda *_: True) == []
    job.attempt = 1
    assert awaited.ready({"j": job}, now=100.0, decidable=lambda *_: True) == []  # forgotten
