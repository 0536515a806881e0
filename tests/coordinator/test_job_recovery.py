"""Recovery without a NATS server: one fault is one restart, a hang restarts, a gone
agent is left out at once, evacuations are graceful, spares and shrinking, growing back,
stragglers and numeric faults — over the in-memory store and fake agents."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest
from test_jobs import Cluster, exited, rank0, spec

from coordinator import placement_policy, policy, progress_policy
from coordinator.job_progress import at_risk_ahead
from coordinator.jobs import JobManager
from proto.api import SubmitJob
from proto.commands import CheckpointNow, Launch, Ping, Stop
from proto.conditions import Condition, ConditionKind
from proto.events import (
    JobAtRisk,
    JobFailed,
    JobGrown,
    JobRewound,
    JobShrunk,
    NodeAway,
    SpotNotice,
    WorkerHung,
    WorkerStraggler,
)
from proto.job import JobRecord, JobState
from proto.node import RankReport
from proto.progress import Checkpointed, Finished, Rewound, StepDone, Stragglers

pytestmark = pytest.mark.anyio


async def launched(
    c: Cluster, m: JobManager, nodes: int = 2, min_nodes: int | None = None, spares: int = 0
) -> JobRecord:
    s = spec(nodes)
    s.job.min_nodes, s.job.spares = min_nodes, spares
    reply = await m.submit(SubmitJob(spec=s, workdir="/w"))
    job = m.jobs[reply.job]
    await m.settle()
    await m.start_pending(job)
    await rank0(m, StepDone(job=job.id, step=5, loss=5.0))
    assert job.state is JobState.RUNNING
    return job


def hung(job: JobRecord, node: str, rank: int = 1) -> WorkerHung:
    return WorkerHung(
        node=node, job=job.id, rank=rank, attempt=job.attempt, step=5, evidence="stopped"
    )


async def test_a_hang_restarts_once_and_a_node_that_hangs_again_is_left_out() -> None:
    c = Cluster()
    m = c.leader()
    job = await launched(c, m)
    await m.on_event(hung(job, "node-1"))
    assert job.state is JobState.RECOVERING and job.restarts == 1 and job.excluded == {}
    assert job.hung_at == {"node-1": [c.clock.time()]}
    await m.on_event(hung(job, "node-1"))  # the same attempt's second report: nothing
    assert job.restarts == 1 and len(job.hung_at["node-1"]) == 1
    await m.settle()
    await m.start_pending(job)
    await rank0(m, StepDone(job=job.id, step=6, loss=5.0))
    await m.on_event(hung(job, "node-1"))
    assert job.restarts == 2 and list(job.excluded) == ["node-1"]
    assert "node-1 hung 2 times within 3600 s, left out" in job.reason


async def test_hangs_an_hour_apart_never_leave_a_node_out() -> None:
    """The hangs that leave a node out are counted within an hour, not the job's life."""
    c = Cluster()
    m = c.leader()
    job = await launched(c, m)
    for restarts in (1, 2, 3):
        await m.on_event(hung(job, "node-1"))
        assert job.restarts == restarts and job.excluded == {}, job.reason
        assert len(job.hung_at["node-1"]) == 1  # the one before is forgotten
        c.advance(3601.0)
        await m.settle()
        await m.start_pending(job)
        await rank0(m, StepDone(job=job.id, step=5 + restarts, loss=5.0))


async def test_a_dead_agent_is_found_by_ping_and_one_fault_costs_one_restart() -> None:
    c = Cluster()
    m = c.leader()
    job = await launched(c, m)
    c.agents.down.add("node-1")  # the machine died: its agent answers nothing
    await m.on_event(exited(job, 0, 1, node="node-0"))  # its peer's rank fails first
    assert job.state is JobState.RECOVERING and job.restarts == 1
    assert list(job.excluded) == ["node-1"] and "node-1 silent, left out" in job.reason
    assert len(c.agents.commands(Ping)) == 1  # node-0 answered; node-1 could not
    assert not c.agents.commands(Stop, "node-1")  # no waiting on a stop nobody hears
    await m.on_event(exited(job, 0, None, node="node-0"))  # the restart's own SIGTERM
    assert job.restarts == 1
    await m.settle()
    await m.start_pending(job)
    assert job.nodes == ["node-0", "node-2"]


async def test_a_lost_node_whose_ranks_still_step_is_not_restarted(
    cluster: Cluster, manager: JobManager
) -> None:
    c, m = cluster, manager
    job = await launched(c, m)
    c.advance(5.0, "node-1")  # its agent went quiet
    await rank0(m, StepDone(job=job.id, step=9, loss=4.0))  # ... ranks still step
    await m.on_event(NodeAway(node="node-1"))
    assert job.state is JobState.RUNNING and job.restarts == 0


@pytest.mark.parametrize(("ahead", "restarted"), [(3, False), (1, True)])
async def test_rank_0_silent_with_its_node_is_judged_by_its_peers_steps(
    ahead: int, restarted: bool
) -> None:
    """Rank 0's node off the bus: its word (job.step) stops with its agent's, but the peer
    node's beat says how far its own rank got. Steps past rank 0's word mean rank 0 steps
    too; a peer at most one step on is what a dead rank 0 leaves behind. (Rank 0's last
    word came before node-0 was due again: no step since it went silent.)"""
    c = Cluster()
    m = c.leader()
    job = await launched(c, m)
    peer = c.registry.nodes["node-1"]
    report = RankReport(job=job.id, rank=1, attempt=job.attempt, pid=1, alive=True)
    peer.ranks = [msgspec.structs.replace(report, last_step=job.step + ahead)]
    await m.on_event(NodeAway(node="node-0"))
    assert (job.state is JobState.RECOVERING) is restarted and job.restarts == int(restarted)


async def test_a_preemption_checkpoints_at_a_boundary_and_resumes_from_there() -> None:
    c = Cluster()
    m = c.leader()
    job = await launched(c, m)
    cond = Condition(kind=ConditionKind.PREEMPTION, node="node-1", subject="aws")
    await m.on_event(SpotNotice(node="node-1", condition=cond))
    await m.settle()
    [stop, *_] = c.agents.commands(Stop, "node-0")
    assert isinstance(stop, Stop) and not stop.force and stop.grace_s > 0
    # the ranks stop themselves at the next boundary, with a durable checkpoint
    await rank0(m, Finished(job=job.id, step=6, outcome="stopped"))
    for rank, node in ((0, "node-0"), (1, "node-1")):
        await m.on_event(exited(job, rank, 0, node=node))
    assert job.state is JobState.RECOVERING  # a restart, not the job stopping
    await m.settle()
    await m.start_pending(job)
    assert job.state is JobState.STARTING and job.nodes == ["node-0", "node-2"]


async def test_with_no_node_left_a_job_shrinks_to_min_nodes_and_grows_back() -> None:
    c = Cluster(nodes=2)
    m = c.leader()
    job = await launched(c, m, min_nodes=1)
    await m.on_event(NodeAway(node="node-1"))
    await m.settle()
    await m.start_pending(job)
    assert job.nodes == ["node-0"] and job.world_size == 1
    shrunk = [e for e in c.events if isinstance(e, JobShrunk)]
    assert shrunk and shrunk[0].previous_world_size == 2 and shrunk[0].world_size == 1
    await rank0(m, StepDone(job=job.id, step=7, loss=4.0))
    c.beat("node-2")  # a healthy node registers
    stops = len(c.agents.commands(Stop))
    await m.tick()
    assert job.state is JobState.RUNNING  # not before it ran a while on its nodes
    c.advance(60.0, "node-1")
    await m.tick()
    assert job.state is JobState.RECOVERING and job.restarts == 1  # growing is uncharged
    await m.settle()
    [grow] = c.agents.commands(Stop)[stops:]
    assert isinstance(grow, Stop) and not grow.force  # gracefully, from a checkpoint
    await m.settle()
    await m.start_pending(job)
    assert job.nodes == ["node-0", "node-2"]
    assert any(isinstance(e, JobGrown) and e.world_size == 2 for e in c.events)


async def test_without_min_nodes_a_job_waits_then_fails_with_the_reason() -> None:
    c = Cluster(nodes=2)
    m = c.leader()
    job = await launched(c, m)
    await m.on_event(NodeAway(node="node-1"))
    await m.settle()
    await m.start_pending(job)
    assert job.state is JobState.RECOVERING and "waiting for 2 healthy nodes" in job.reason
    assert job.waiting_since is not None
    c.advance(job.spec.policy.wait_for_nodes_s + 1, "node-1")
    await m.tick()
    assert job.state is JobState.FAILED and "waiting for 2 healthy nodes" in job.reason
    assert isinstance(c.events[-1], JobFailed)


async def test_spares_are_held_for_the_job_and_replace_a_lost_node() -> None:
    c = Cluster(nodes=4)
    m = c.leader()
    job = await launched(c, m, spares=1)
    assert job.nodes == ["node-0", "node-1"] and job.spare_nodes == ["node-2"]
    other = await m.submit(SubmitJob(spec=spec(2), workdir="/w"))
    await m.settle()
    await m.start_pending(m.jobs[other.job])  # node-3 alone is free: it must wait
    assert m.jobs[other.job].state is JobState.PENDING
    await m.on_event(NodeAway(node="node-0"))
    await m.settle()
    await m.start_pending(job)
    assert job.nodes == ["node-1", "node-2"]
    assert not [e for e in c.events if isinstance(e, JobShrunk)]


async def test_a_straggler_is_reported_once_and_replaced_when_the_job_has_a_spare() -> None:
    c = Cluster(nodes=4)
    m = c.leader()
    plain = await launched(c, m)
    slow = Stragglers(job=plain.id, step=20, rank_step_s=[0.1, 0.31], window_steps=20)
    for _ in range(3):
        await rank0(m, slow)
    found = [e for e in c.events if isinstance(e, WorkerStraggler)]
    assert len(found) == 1 and found[0].node == "node-1" and found[0].rank == 1
    assert found[0].ratio == pytest.approx(3.1)
    assert plain.state is JobState.RUNNING  # no spare: an event only
    c2 = Cluster(nodes=4)
    m2 = c2.leader()
    spared = await launched(c2, m2, spares=1)
    for _ in range(2):
        await rank0(m2, Stragglers(job=spared.id, rank_step_s=[0.3, 0.1], window_steps=20))
    assert spared.state is JobState.RECOVERING and spared.restarts == 0
    assert list(spared.excluded) == ["node-0"]
    await m2.settle()
    await m2.start_pending(spared)
    assert spared.nodes == ["node-1", "node-2"]


async def test_a_rank_slow_in_windows_apart_is_no_straggler() -> None:
    """A rank is a straggler when it is slow in two windows in a row; a slow window
    between normal ones is the host's hiccup (a checkpoint write, a neighbour's burst)."""
    c = Cluster(nodes=4)
    m = c.leader()
    job = await launched(c, m, spares=1)
    slow = Stragglers(job=job.id, step=20, rank_step_s=[0.1, 0.31], window_steps=20)
    even = Stragglers(job=job.id, step=40, rank_step_s=[0.1, 0.11], window_steps=20)
    for window in (slow, even, slow, even, slow):
        await rank0(m, window)
    assert not [e for e in c.events if isinstance(e, WorkerStraggler)]
    assert job.state is JobState.RUNNING and job.nodes == ["node-0", "node-1"]
    await rank0(m, slow)
    assert [e.rank for e in c.events if isinstance(e, WorkerStraggler)] == [1]
    assert job.state is JobState.RECOVERING and list(job.excluded) == ["node-1"]


def test_stragglers_compare_each_rank_with_the_median_of_the_others() -> None:
    assert progress_policy.stragglers([0.1, 0.1, 0.1, 0.16], 1.5) == {3: (0.16, 0.1)}
    assert progress_policy.stragglers([0.1, 0.1, 0.1, 0.14], 1.5) == {}
    assert progress_policy.stragglers([0.1], 1.5) == {}


async def test_a_numeric_fault_that_keeps_coming_back_fails_the_job_with_the_evidence() -> None:
    c = Cluster()
    m = c.leader()
    job = await launched(c, m)
    limit = job.spec.policy.max_rewinds
    bad = Rewound(
        job=job.id,
        step=50,
        from_step=57,
        skip_from=50,
        skip_to=58,
        reason="non-finite loss nan",
        ranks=[0, 1],
    )
    for _ in range(limit):
        await rank0(m, bad)
        c.advance(5.0)
    rewound = [e for e in c.events if isinstance(e, JobRewound)]
    assert len(rewound) == limit and rewound[0].to_step == 50 and rewound[0].skip_to == 58
    assert "steps 50-57 skipped; non-finite on rank 0, 1" in rewound[0].message
    assert rewound[0].ranks == [0, 1] and rewound[0].suspect == ""  # every node's
    assert job.state is JobState.RUNNING and job.step == 50
    await rank0(m, bad)
    assert job.state is JobState.FAILED and "non-finite loss nan" in job.reason
    assert "3 times in a row within 50 steps of each other or on the same data" in job.reason
    assert f"rewound 2 times (policy.max_rewinds = {limit}), not on one node alone" in job.reason
    assert not c.agents.commands(Launch, "node-2")


async def test_one_nodes_numeric_faults_hold_it_and_the_job_goes_on_elsewhere() -> None:
    """Far apart, but the ranks of node-1 alone each time: the third holds node-1 for a
    person (on the node keeper's next look) and restarts the job without it, uncharged."""
    c = Cluster()
    m = c.leader()
    job = await launched(c, m)
    for k, step in enumerate((100, 1100, 2100)):
        await rank0(m, StepDone(job=job.id, step=step, loss=4.0))
        bad = Rewound(
            job=job.id,
            step=step,
            from_step=step + 3,
            skip_from=step,
            skip_to=step + 4,
            reason="non-finite loss nan",
            ranks=[1],
        )
        await rank0(m, bad)
        assert [e.suspect for e in c.events if isinstance(e, JobRewound)][-1] == "node-1"
        if k < 2:
            assert job.state is JobState.RUNNING and c.registry.nodes["node-1"].hold_for == ""
            c.advance(600.0)
    assert job.state is JobState.RECOVERING and list(job.excluded) == ["node-1"]
    assert job.restarts == 1 and job.restarts_in_row == 0
    held = c.registry.nodes["node-1"].hold_for
    assert held.startswith("the ranks of node-1 alone computed non-finite values 3 times")
    assert "step 103 (node-1 alone" in held and "step 2103 (node-1 alone" in held
    assert job.numeric_faults == []  # spent: they count no further
    await m.settle()
    await m.start_pending(job)
    assert job.nodes == ["node-0", "node-2"]


def test_a_job_whose_checkpoints_cannot_reshard_does_not_shrink() -> None:
    record = JobRecord(id="j", name="j", spec=spec(4), attempt=1)
    record.spec.job.min_nodes = 2
    assert placement_policy.minimum_nodes(record) == 2  # deepspeed ZeRO-1: it reshards
    record.spec.train.zero_stage = 3
    assert placement_policy.minimum_nodes(record) == 2  # so does ZeRO-3
    record.spec.train.zero_stage = 0
    assert placement_policy.minimum_nodes(record) == 4
    record.spec.train.engine = "fsdp"
    assert placement_policy.minimum_nodes(record) == 2
    record.attempt = 0  # a first start waits for every node it asked for
    assert placement_policy.minimum_nodes(record) == 4


async def test_a_late_step_of_the_previous_attempt_does_not_make_the_next_one_running() -> None:
    c = Cluster()
    m = c.leader()
    job = await launched(c, m)
    await m.on_event(exited(job, 1, 1, node="node-1"))
    await m.settle()
    await m.start_pending(job)
    assert job.state is JobState.STARTING and job.attempt == 2
    await rank0(m, StepDone(job=job.id, step=9, loss=4.0, attempt=1))
    assert job.state is JobState.STARTING
    await rank0(m, StepDone(job=job.id, step=6, loss=4.0, attempt=2))
    assert job.state is JobState.RUNNING


async def test_late_steps_of_the_replaced_attempt_are_training_then_redone_work(
    cluster: Cluster, manager: JobManager
) -> None:
    """Rank 0's last steps can reach the coordinator after the relaunch (a loaded node
    relays them late): what the ledger charged as recovery up to their stamps was
    training, and the next attempt, resumed from before them, redoes them: lost work."""
    c, m = cluster, manager
    job = await launched(c, m)  # 2 ranks, step 5
    job.step_s = 0.25
    job.goodput["productive"] = 100.0  # its 50 s of training so far
    c.advance(2.0)  # its newest step, 2 s ago
    await m.on_event(exited(job, 1, 1, node="node-1"))
    await m.settle()
    await m.start_pending(job)
    assert job.state is JobState.STARTING and job.given_up is not None
    assert job.given_up.node == "node-0" and job.given_up.attempt == 1
    trained = job.goodput["productive"]
    late = StepDone(job=job.id, step=8, loss=4.0, attempt=1, time=c.clock.time() - 1.0)
    await m.on_progress(late, "node-1")  # not its rank 0's node: no word of it
    assert job.goodput["productive"] == trained and job.failed_at_step == 5
    await m.on_progress(late, "node-0")
    assert job.goodput["productive"] == pytest.approx(trained + 1.0 * 2, abs=1e-9)
    assert job.failed_at_step == 8 and job.state is JobState.STARTING
    await m.on_progress(late, "node-0")  # repeated: nothing more
    assert job.goodput["productive"] == pytest.approx(trained + 1.0 * 2, abs=1e-9)
    lost = job.goodput["lost_work"]
    await rank0(m, StepDone(job=job.id, step=6, loss=4.0))  # resumed from step 5
    assert job.state is JobState.RUNNING and job.given_up is None
    assert job.goodput["lost_work"] - lost == pytest.approx(3 * 0.25 * 2)  # steps 6 to 8
    productive = job.goodput["productive"]
    await m.on_progress(StepDone(job=job.id, step=9, attempt=1, time=c.clock.time()), "node-0")
    assert job.failed_at_step == 8 and job.goodput["productive"] >= productive


async def test_a_notice_shorter_than_the_measured_checkpoint_time_is_said_first(
    cluster: Cluster, manager: JobManager
) -> None:
    c, m = cluster, manager
    job = await launched(c, m)
    every = job.spec.checkpoint.every_steps
    await rank0(m, StepDone(job=job.id, step=every, loss=4.0, attempt=job.attempt))
    await rank0(m, Checkpointed(job=job.id, step=every, path="/c", attempt=job.attempt))
    assert job.checkpoint_s is not None and job.checkpoint_s >= 0
    assert policy.at_risk(job, "node-1", 5.0 + job.checkpoint_s) is None  # it fits
    job.checkpoint_s = 12.0  # as measured on a large model
    cond = Condition(kind=ConditionKind.PREEMPTION, node="node-1", subject="gcp")
    deadline = datetime.fromtimestamp(c.clock.time() + 5.0, UTC)
    await m.on_event(SpotNotice(node="node-1", deadline=deadline, condition=cond))
    [risk] = [e for e in c.events if isinstance(e, JobAtRisk)]
    assert risk.checkpoint_s == 12.0 and 4.0 < risk.window_s <= 5.0
    assert risk.last_checkpoint_step == every and f"since step {every}" in risk.message
    kinds = [type(e).__name__ for e in c.events]
    assert kinds.index("JobAtRisk") < kinds.index("JobRecovering")  # said before acting
    c2 = Cluster()
    fresh = await launched(c2, c2.leader())
    assert policy.at_risk(fresh, "node-1", 1.0) is None  # nothing measured: no evidence


async def test_checkpoints_longer_than_the_expected_notice_are_said_and_made_often(
    cluster: Cluster, manager: JobManager
) -> None:
    c, m = cluster, manager
    job = await launched(c, m)
    job.spec.policy.preemption_notice_s = 30.0
    every = job.spec.checkpoint.every_steps
    await rank0(m, StepDone(job=job.id, step=every, loss=4.0, attempt=job.attempt))
    await rank0(m, Checkpointed(job=job.id, step=every, path="/c", attempt=job.attempt))
    assert not [e for e in c.events if isinstance(e, JobAtRisk)]  # fast: it fits a notice
    job.checkpoint_s = 50.0  # measured on a large model
    assert policy.bounded_cadence(job) == 50.0
    for _ in range(2):  # said the first time only
        if (said := at_risk_ahead(job, c.clock.time())) is not None:
            await m.publish(said)
    [risk] = [e for e in c.events if isinstance(e, JobAtRisk)]
    assert risk.window_s == 30.0 and "checkpointing every 50 s" in risk.message
    c.advance(51.0)
    await m.tick()
    [asked] = c.agents.commands(CheckpointNow, "node-0")
    assert "preemption" in asked.reason  # type: ignore[attr-defined]
    assert job.state is JobState.CHECKPOINTING
    job.state = JobState.RUNNING
    await m.tick()  # not again before another 50 s
    assert len(c.agents.commands(CheckpointNow)) == 1
    job.spec.policy.preemption_notice_s = None
    assert policy.bounded_cadence(job) is None
