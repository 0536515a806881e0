"""The job state machine (docs/architecture.md, ``proto.job.JobState``) without a NATS
server: the job manager over the in-memory compare-and-set store and fake agents that
fence by epoch. Each test follows one transition and checks the record in the store, the
commands the agents accepted and the events published. Time is a manual clock: it passes
only when a test advances it."""

from __future__ import annotations

import pytest

from coordinator import jobs as jobs_module
from coordinator.cas import Conflict, MemoryCasStore
from coordinator.fake_agents import FakeAgents
from coordinator.jobs import JobManager
from coordinator.registry import Registry
from proto.api import JobControl, SubmitJob
from proto.codec import encode, job_decoder
from proto.commands import CheckpointNow, Launch, Pause, ReservePort, Resume, ResyncClock, Stop
from proto.conditions import Condition, ConditionKind, condition_key
from proto.events import (
    ClockDrift,
    EventBase,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobPaused,
    JobRecovering,
    JobRestarted,
    JobStarted,
    JobStopped,
    JobSubmitted,
    NodeAway,
    NodeRefused,
    NvmeLatencyRecovered,
    NvmeLatencySpike,
    WorkerExited,
    kind_of,
)
from proto.job import JobRecord, JobSection, JobSpec, JobState
from proto.node import Heartbeat
from proto.progress import Checkpointed, Finished, Paused, Progress, Resumed, StepDone
from ringmaster.clock import ManualClock

pytestmark = pytest.mark.anyio


class Cluster:
    """One store, one set of agents, one registry and one manual clock, shared by every
    leader a test makes: the clock moves only when the test advances it, and every leader,
    the agents' replies and the beats read it."""

    def __init__(self, nodes: int = 3) -> None:
        self.clock = ManualClock()
        self.store = MemoryCasStore()
        self.agents = FakeAgents(clock=self.clock)
        self.registry = Registry()
        self.events: list[EventBase] = []
        for i in range(nodes):
            self.beat(f"node-{i}")

    def beat(self, node: str, *conditions: Condition) -> None:
        index = int(node.rsplit("-", 1)[1])
        beat = Heartbeat(
            node=node,
            seq=1,
            sent_at=0.0,
            addr=f"10.0.0.{index + 1}",
            gpus=1,
            conditions=[*conditions],
        )
        self.registry.observe(beat, now=self.clock.monotonic())

    def advance(self, seconds: float, *silent: str) -> None:
        """``seconds`` pass, and then every node beats but the ``silent`` ones (a beat
        carries the agent's whole word: what a test set on a node's record is replaced)."""
        self.clock.advance(seconds)
        for node in list(self.registry.nodes):
            if node not in silent:
                self.beat(node)

    def leader(self, me: str = "c-0", epoch: int = 1) -> JobManager:
        async def publish(event: EventBase) -> None:
            self.events.append(event)

        sender = self.agents.sender(me, lambda: epoch)
        return JobManager(self.store, sender, self.registry, publish, clock=self.clock)

    async def stored(self, job_id: str) -> JobRecord:
        found = await self.store.get(job_id)
        assert found is not None
        record: JobRecord = job_decoder.decode(found[0])
        return record

    def kinds(self) -> list[str]:
        return [kind_of(e) for e in self.events]


def spec(nodes: int = 2, **train: object) -> JobSpec:
    s = JobSpec(job=JobSection(name="t", nodes=nodes))
    s.train.steps = 100
    for key, value in train.items():
        setattr(s.train, key, value)
    return s


async def submitted(c: Cluster, m: JobManager, nodes: int = 2) -> JobRecord:
    reply = await m.submit(SubmitJob(spec=spec(nodes), workdir="/w"))
    assert reply.ok
    return m.jobs[reply.job]


async def running(c: Cluster, m: JobManager) -> JobRecord:
    job = await submitted(c, m)
    await m.start_pending(job)
    await rank0(m, StepDone(job=job.id, step=1, loss=5.0, tokens_per_s=1000.0))
    assert job.state is JobState.RUNNING
    return job


def exited(job: JobRecord, rank: int, code: int | None, node: str = "") -> WorkerExited:
    """Rank ``rank``'s exit, from the node hosting it unless ``node`` says otherwise."""
    signal = 15 if code is None else None
    node = node or job.nodes[rank // job.spec.job.gpus_per_node]
    return WorkerExited(
        node=node, job=job.id, rank=rank, exit_code=code, signal=signal, attempt=job.attempt
    )


async def rank0(m: JobManager, msg: Progress) -> None:
    """Rank 0's progress as its node relays it: stamped with the job's current attempt
    (unless the message names one) and sent from the node hosting rank 0."""
    job = m.jobs[msg.job]
    msg.attempt = msg.attempt or job.attempt
    await m.on_progress(msg, job.nodes[0] if job.nodes else "")


def spike(node: str, dev: str, active: bool = True) -> EventBase:
    cond = Condition(
        kind=ConditionKind.NVME_LATENCY, node=node, subject=dev, active=active, value=500.0
    )
    if active:
        return NvmeLatencySpike(node=node, device=dev, latency_us=500.0, condition=cond)
    return NvmeLatencyRecovered(node=node, device=dev, latency_us=20.0, condition=cond)


# -- pending --------------------------------------------------------------------------


async def test_submit_records_a_pending_job() -> None:
    c = Cluster()
    job = await submitted(c, c.leader())
    assert (await c.stored(job.id)).state is JobState.PENDING
    assert job.spec.checkpoint.dir == "/w/checkpoints"  # relative to where start ran
    assert c.kinds() == ["job.submitted"] and isinstance(c.events[0], JobSubmitted)


async def test_pending_to_starting_admits_reserves_and_launches() -> None:
    c = Cluster()
    m = c.leader()
    job = await submitted(c, m)
    await m.start_pending(job)
    stored = await c.stored(job.id)
    assert stored.state is JobState.STARTING and stored.attempt == 1
    assert stored.nodes == ["node-0", "node-1"] and stored.world_size == 2
    assert (stored.master_addr, stored.master_port) == ("10.0.0.1", c.agents.port)
    assert len(c.agents.commands(ReservePort, "node-0")) == 1
    launches = c.agents.commands(Launch)
    assert [[r.rank for r in cmd.ranks] for cmd in launches] == [[0], [1]]  # type: ignore[attr-defined]
    assert all(cmd.epoch == 1 for cmd in launches)
    assert isinstance(c.events[-1], JobStarted) and c.events[-1].nodes == ["node-0", "node-1"]


async def test_job_started_says_where_training_resumes_from() -> None:
    c = Cluster()
    m = c.leader()
    fresh = await submitted(c, m, nodes=1)
    req = SubmitJob(spec=spec(1), workdir="/w", resume_step=60, resume_job="t-0a1b2c")
    resumed = m.jobs[(await m.submit(req)).job]
    assert (await c.stored(resumed.id)).resume_step == 60
    for job in (fresh, resumed):
        await m.start_pending(job)
    first, second = (e for e in c.events if isinstance(e, JobStarted))
    assert first.job == fresh.id and first.resume_step is None
    assert first.message.startswith("fresh start; ")
    assert (second.resume_step, second.resume_job) == (60, "t-0a1b2c")
    assert second.message.startswith("resuming from step 60 (job t-0a1b2c); ")


async def test_pending_waits_with_a_reason_when_too_few_nodes_are_healthy() -> None:
    c = Cluster(nodes=2)
    c.beat("node-1", Condition(kind=ConditionKind.PREFLIGHT, node="node-1", reason="shm 1 GB"))
    m = c.leader()
    job = await submitted(c, m)
    await m.start_pending(job)
    assert job.state is JobState.PENDING
    assert "node-1: preflight failed" in job.reason
    assert c.agents.commands(Launch) == []
    [refused] = [e for e in c.events if isinstance(e, NodeRefused)]
    assert refused.node == "node-1"


async def test_a_failed_launch_is_undone_and_the_job_stays_pending() -> None:
    c = Cluster()
    c.agents.failing["node-1"] = "pre_start exited 3"
    m = c.leader()
    job = await submitted(c, m)
    await m.start_pending(job)
    stored = await c.stored(job.id)
    assert stored.state is JobState.PENDING
    assert "node-1: pre_start exited 3" in stored.reason
    undo = c.agents.commands(Stop, "node-0")
    assert len(undo) == 1 and undo[0].force  # type: ignore[attr-defined]


async def test_stopping_a_pending_job_stops_it_at_once() -> None:
    c = Cluster()
    m = c.leader()
    job = await submitted(c, m)
    assert (await m.control(JobControl(job=job.id, action="stop"))).ok
    assert (await c.stored(job.id)).state is JobState.STOPPED
    assert isinstance(c.events[-1], JobStopped)


# -- starting, running ----------------------------------------------------------------


async def test_starting_to_running_on_the_first_step() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    await m.flush()
    stored = await c.stored(job.id)
    assert stored.state is JobState.RUNNING and stored.step == 1 and stored.loss == 5.0
    assert stored.tokens_per_s == 1000.0 and stored.first_step_at is not None
    assert stored.mfu is None and stored.compile_s is None  # CPU, not compiled
    await rank0(m, StepDone(job=job.id, step=2, loss=4.9, mfu=0.47, compile_s=31.5))
    await rank0(m, StepDone(job=job.id, step=3, loss=4.8, mfu=0.48))
    await m.flush()
    stored = await c.stored(job.id)
    assert (stored.mfu, stored.compile_s) == (0.48, 31.5)  # compile time is kept


async def test_running_paused_and_resumed_by_the_operator() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    assert (await m.control(JobControl(job=job.id, action="pause"))).ok
    assert len(c.agents.commands(Pause, "node-0")) == 1
    operator = condition_key(ConditionKind.OPERATOR, job=job.id)
    assert job.pause_reasons == [operator]
    await rank0(m, Paused(job=job.id, step=7))
    assert job.state is JobState.PAUSED and job.pauses == 1
    assert isinstance(c.events[-1], JobPaused) and c.events[-1].reason == operator
    assert (await m.control(JobControl(job=job.id, action="resume"))).ok
    assert len(c.agents.commands(Resume, "node-0")) == 1 and job.pause_reasons == []
    await rank0(m, Resumed(job=job.id, step=7))
    await m.flush()  # the ticker's flush: progress is saved in batches
    assert (await c.stored(job.id)).state is JobState.RUNNING


async def test_running_to_checkpointing_and_back() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    assert (await m.control(JobControl(job=job.id, action="checkpoint"))).ok
    assert len(c.agents.commands(CheckpointNow, "node-0")) == 1
    assert job.state is JobState.CHECKPOINTING
    await rank0(m, Checkpointed(job=job.id, step=9, path="/ck/step-9", stall_s=0.2))
    await m.flush()
    stored = await c.stored(job.id)
    assert stored.state is JobState.RUNNING and stored.last_checkpoint_step == 9
    assert isinstance(c.events[-1], JobCheckpointed) and c.events[-1].stall_s == 0.2


async def test_a_lost_checkpoint_report_costs_the_record_one_step_report() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    await rank0(m, Checkpointed(job=job.id, step=20, path="/ck/step-20"))
    await rank0(m, StepDone(job=job.id, step=21, durable_step=20))
    assert [e.step for e in c.events if isinstance(e, JobCheckpointed)] == [20]  # said once
    # step 40's own report was lost on the bus: step 41's report names it durable
    await rank0(m, StepDone(job=job.id, step=41, durable_step=40))
    await m.flush()
    assert (await c.stored(job.id)).last_checkpoint_step == 40
    said = [e for e in c.events if isinstance(e, JobCheckpointed)]
    assert [e.step for e in said] == [20, 40] and "never arrived" in said[-1].message
    await rank0(m, StepDone(job=job.id, step=42, durable_step=40))
    assert len([e for e in c.events if isinstance(e, JobCheckpointed)]) == 2


async def test_running_to_completed_when_every_rank_is_done() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    await rank0(m, Finished(job=job.id, step=100, outcome="completed"))
    await m.on_event(exited(job, 0, 0))
    assert job.state is JobState.RUNNING  # rank 1 is still running
    await m.on_event(exited(job, 1, 0, node="node-1"))
    stored = await c.stored(job.id)
    assert stored.state is JobState.COMPLETED and stored.step == 100
    assert isinstance(c.events[-1], JobCompleted)


async def test_clean_exits_without_the_final_word_fail_when_overdue(
    cluster: Cluster, manager: JobManager
) -> None:
    c, m = cluster, manager
    job = await running(c, m)
    await m.on_event(exited(job, 0, 0))
    await m.on_event(exited(job, 1, 0, node="node-1"))
    assert job.state is JobState.RUNNING
    await m.tick()
    assert job.state is JobState.RUNNING  # rank 0's word may still be on its way
    c.advance(jobs_module.OVERDUE_S + 0.1)
    await m.tick()
    stored = await c.stored(job.id)
    assert stored.state is JobState.FAILED and "ranks exited at step 1" in stored.reason


async def test_stop_is_graceful_and_ends_stopped_when_the_ranks_are_gone() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    c.agents.down.add("node-1")  # the agents answer once their ranks are gone; node-1 never
    assert (await m.control(JobControl(job=job.id, action="stop"))).ok
    assert (await c.stored(job.id)).stopping  # on record before any node is told
    await m.on_event(exited(job, 0, None))
    assert job.state is JobState.RUNNING  # one rank of two gone: not stopped yet
    await m.settle()
    graceful, *killed = c.agents.commands(Stop)
    assert not graceful.force and graceful.grace_s > 0  # type: ignore[attr-defined]
    assert all(k.force for k in killed)  # type: ignore[attr-defined]  # whatever remains
    stored = await c.stored(job.id)
    assert stored.state is JobState.STOPPED
    assert "node-1 did not confirm the stop" in stored.reason  # named, and stopped anyway
    assert isinstance(c.events[-1], JobStopped) and "node-1" in c.events[-1].message


async def test_stop_ends_as_soon_as_every_rank_has_exited() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    await m.control(JobControl(job=job.id, action="stop"))
    await m.on_event(exited(job, 0, None))
    await m.on_event(exited(job, 1, None))
    assert (await c.stored(job.id)).state is JobState.STOPPED


async def test_a_stop_for_a_requeue_ends_marked_so_whichever_path_ends_it() -> None:
    """The ranks' exits end the stop (the progress policy's finish) before the stop's own
    task does: the requeue the stop asked for must survive either."""
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    why = "Slurm sent SIGUSR1: the allocation ends (time limit or preemption)"
    stop = JobControl(job=job.id, action="stop", reason=why, requeue=True)
    assert (await m.control(stop)).ok
    await m.on_event(exited(job, 0, None))
    await m.on_event(exited(job, 1, None))
    stored = await c.stored(job.id)
    assert stored.state is JobState.STOPPED and stored.requeue and stored.reason == why


async def test_control_of_unknown_or_finished_jobs_is_refused() -> None:
    c = Cluster()
    m = c.leader()
    assert not (await m.control(JobControl(job="nope", action="pause"))).ok
    job = await submitted(c, m)
    await m.control(JobControl(job=job.id, action="stop"))
    reply = await m.control(JobControl(job=job.id, action="resume"))
    assert not reply.ok and "already stopped" in reply.error


# -- recovery -------------------------------------------------------------------------


async def test_a_failed_rank_recovers_and_restarts_on_the_same_nodes() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    await m.on_event(exited(job, 1, 1, node="node-1"))
    stored = await c.stored(job.id)
    assert stored.state is JobState.RECOVERING and stored.restarts == 1
    assert stored.stopping_attempt == 1  # on record before the stop is sent
    assert isinstance(c.events[-1], JobRecovering)
    await m.tick()
    assert c.agents.commands(Launch, "node-1") == [c.agents.commands(Launch, "node-1")[0]]
    await m.settle()  # the stop runs as a task; its end lets the next attempt launch
    stops = c.agents.commands(Stop)
    assert len(stops) == 2 and all(s.force and s.attempt == 1 for s in stops)  # type: ignore[attr-defined]
    assert job.stopping_attempt == 0 and job.state is JobState.RECOVERING
    await m.start_pending(job)
    stored = await c.stored(job.id)
    assert stored.state is JobState.STARTING and stored.attempt == 2
    assert stored.nodes == ["node-0", "node-1"]
    assert isinstance(c.events[-1], JobRestarted)
    assert [cmd.attempt for cmd in c.agents.commands(Launch, "node-1")] == [1, 2]  # type: ignore[attr-defined]


async def test_a_lost_node_while_paused_recovers_without_it() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    await m.control(JobControl(job=job.id, action="pause"))
    await rank0(m, Paused(job=job.id, step=3))
    await m.on_event(NodeAway(node="node-1"))
    assert job.state is JobState.RECOVERING and list(job.excluded) == ["node-1"]
    await m.settle()
    await m.start_pending(job)
    assert job.nodes == ["node-0", "node-2"]
    # the operator's pause still holds: the new rank 0 is told to pause again
    assert len(c.agents.commands(Pause, "node-0")) == 2


async def test_recovering_fails_once_the_restart_budget_is_spent() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    job.spec.policy.max_restarts = 1
    await rank0(m, StepDone(job=job.id, step=5, loss=4.0))
    await m.on_event(exited(job, 0, 1))  # failed at step 5
    await m.start_pending(job)
    await rank0(m, StepDone(job=job.id, step=5, loss=4.0))  # from a checkpoint, not past
    await m.on_event(exited(job, 0, 1))
    stored = await c.stored(job.id)
    assert stored.state is JobState.FAILED and "restart budget of 1 spent" in stored.reason
    assert isinstance(c.events[-1], JobFailed)


async def test_faults_the_job_trained_past_do_not_spend_the_budget() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    job.spec.policy.max_restarts = 1
    for fault in range(3):
        await rank0(m, StepDone(job=job.id, step=10 * (fault + 1), loss=4.0))
        await m.on_event(exited(job, 0, 1))
        await m.start_pending(job)
        assert job.state is JobState.STARTING and job.restarts == fault + 1


# -- conditions -----------------------------------------------------------------------


async def test_two_devices_in_a_spike_pause_once_and_resume_after_the_last() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    await m.on_event(spike("node-1", "nvme0n1"))
    await m.on_event(spike("node-1", "nvme1n1"))
    assert len(c.agents.commands(Pause)) == 1 and len(job.pause_reasons) == 2
    await rank0(m, Paused(job=job.id, step=4))
    await m.on_event(spike("node-1", "nvme0n1", active=False))
    assert c.agents.commands(Resume) == []
    await m.on_event(spike("node-1", "nvme1n1", active=False))
    assert len(c.agents.commands(Resume)) == 1 and job.pause_reasons == []


async def test_an_operator_pause_during_a_spike_resumes_only_when_both_close() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    await m.on_event(spike("node-0", "nvme0n1"))
    await rank0(m, Paused(job=job.id, step=4))
    assert (await m.control(JobControl(job=job.id, action="pause"))).ok
    assert len(c.agents.commands(Pause)) == 1  # already paused: nothing more to send
    await m.on_event(spike("node-0", "nvme0n1", active=False))
    assert c.agents.commands(Resume) == []  # the operator's pause still holds
    reply = await m.control(JobControl(job=job.id, action="resume"))
    assert reply.ok and len(c.agents.commands(Resume)) == 1


async def test_an_operator_resume_cannot_override_an_open_fault() -> None:
    c = Cluster()
    m = c.leader()
    job = await running(c, m)
    await m.control(JobControl(job=job.id, action="pause"))
    await m.on_event(spike("node-1", "nvme0n1"))
    reply = await m.control(JobControl(job=job.id, action="resume"))
    key = condition_key(ConditionKind.NVME_LATENCY, "node-1", "nvme0n1")
    assert not reply.ok and reply.error == f"job {job.id} stays paused: {key}"
    assert c.agents.commands(Resume) == [] and job.pause_reasons == [key]


async def test_a_clock_condition_resyncs_the_node_whatever_its_jobs() -> None:
    c = Cluster()
    m = c.leader()
    drift = Condition(kind=ConditionKind.CLOCK, node="node-2", value=12.0, reason="12 ms off")
    await m.on_event(ClockDrift(node="node-2", offset_ms=12.0, condition=drift))
    assert len(c.agents.commands(ResyncClock, "node-2")) == 1


# -- leaders --------------------------------------------------------------------------


async def test_a_new_leader_loads_every_job_and_skips_unreadable_records() -> None:
    c = Cluster()
    old = c.leader()
    job = await running(c, old)
    await old.flush()
    await c.store.create("garbage", b"{not json")
    new = c.leader("c-1", epoch=2)
    await new.load()
    assert list(new.jobs) == [job.id]
    assert new.jobs[job.id].state is JobState.RUNNING


async def handover() -> tuple[Cluster, JobManager, JobManager, JobRecord]:
    """A running job whose leader (epoch 1) is succeeded by another (epoch 2) that has
    loaded every record; the old one has not noticed yet."""
    c = Cluster()
    old = c.leader("c-0", epoch=1)
    job = await running(c, old)
    await old.flush()
    new = c.leader("c-1", epoch=2)
    await new.load()
    return c, old, new, job


async def test_a_stale_epoch_is_refused_by_the_agents() -> None:
    c, old, new, job = await handover()
    assert (await new.control(JobControl(job=job.id, action="checkpoint"))).ok
    with pytest.raises(Conflict):  # and its record write loses too
        await old.control(JobControl(job=job.id, action="checkpoint"))
    [(node, refused)] = c.agents.refused
    assert node == "node-0" and isinstance(refused, CheckpointNow) and refused.epoch == 1
    assert len(c.agents.commands(CheckpointNow)) == 1  # the new leader's alone


async def test_a_deposed_leaders_pause_is_never_sent() -> None:
    c, old, new, job = await handover()
    await rank0(new, StepDone(job=job.id, step=2, loss=4.5))
    await new.flush()
    with pytest.raises(Conflict):
        await old.on_event(spike("node-1", "nvme0n1"))
    assert c.agents.commands(Pause) == [] and c.agents.refused == []
    assert (await c.stored(job.id)).pause_reasons == []


async def test_a_leader_change_mid_transition_leaves_the_successor_state() -> None:
    """The deposed leader decides a restart from its stale copy: its save loses the
    compare-and-set, nothing is sent, and its copy becomes the successor's record."""
    c, old, new, job = await handover()
    await rank0(new, StepDone(job=job.id, step=2, loss=4.5))
    await new.flush()
    stops_before = len(c.agents.commands(Stop))
    with pytest.raises(Conflict):
        await old.on_event(exited(job, 1, 1, node="node-1"))
    stored = await c.stored(job.id)
    assert stored.state is JobState.RUNNING and stored.restarts == 0 and stored.step == 2
    assert len(c.agents.commands(Stop)) == stops_before
    assert "job.recovering" not in c.kinds()
    assert old.jobs[job.id].step == 2  # the loser now holds what the store holds
    assert encode(old.jobs[job.id]) == encode(stored)


async def test_a_dead_machine_costs_one_restart(cluster: Cluster, manager: JobManager) -> None:
    """node-1 dies with its rank: the peer's exit restarts the job without node-1 (its
    agent is already silent), and the node.lost that follows is no second restart."""
    c, m = cluster, manager
    job = await running(c, m)
    c.advance(2.0, "node-1")  # two beats node-1's agent missed
    await m.on_event(exited(job, 0, 1, node="node-0"))
    assert job.state is JobState.RECOVERING and list(job.excluded) == ["node-1"]
    await m.settle()
    await m.start_pending(job)
    assert job.nodes == ["node-0", "node-2"] and job.state is JobState.STARTING
    await m.on_event(NodeAway(node="node-1"))
    assert job.restarts == 1 and job.state is JobState.STARTING
