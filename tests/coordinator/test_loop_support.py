"""A job knows what its training loop supports (``coordinator.loop_support``): the built-in
trainer by its job file, a user's script by what its rank 0 said when it opened the rank
API, an unmodified script nothing. Commands the loop cannot carry out are refused with the
reason; a pause it cannot take is said once (``job.unheeded``) and the job trains on; its
ledger does not call unmeasured time productive."""

from __future__ import annotations

import pytest

from coordinator import actions, goodput, loop_support, policy
from proto.api import JobControl, SubmitJob
from proto.commands import CheckpointNow, Pause, Stop
from proto.events import JobLoop, JobRecovering, JobRestarted, JobUnheeded
from proto.job import JobRecord, JobSection, JobSpec, JobState, LoopInfo
from proto.progress import LoopReady, PhaseChanged, Reaction, StepDone
from tests.coordinator.test_jobs import Cluster, exited, rank0, spike
from tests.coordinator.test_policy import job as policy_job
from tests.coordinator.test_policy import spike as spike_condition

pytestmark = pytest.mark.anyio


def entry_spec(nodes: int = 2) -> JobSpec:
    return JobSpec(job=JobSection(name="t", nodes=nodes, entry=["train.py"]))


def script(reactions: list[Reaction] | None = None) -> JobRecord:
    record = policy_job(spec=entry_spec())
    if reactions is not None:
        record.loop = LoopInfo(framework="hf", reactions=reactions, attempt=1)
    return record


def test_the_built_in_trainer_has_every_reaction_its_job_file_gives_it() -> None:
    builtin = policy_job()
    assert loop_support.reactions(builtin) == tuple(Reaction)
    builtin.spec.checkpoint.memory_tier = False
    assert Reaction.MEMORY_TIER not in loop_support.reactions(builtin)
    assert loop_support.reports_steps(builtin)


def test_an_unmodified_script_has_none_and_says_how_to_get_them() -> None:
    plain = script()
    assert loop_support.reactions(plain) == () and not loop_support.reports_steps(plain)
    why = loop_support.lacking(plain, Reaction.PAUSE)
    assert why is not None and "ringmaster.rank" in why
    said = script([Reaction.PAUSE, Reaction.HANG_BY_BEAT])
    assert loop_support.lacking(said, Reaction.PAUSE) is None
    assert loop_support.lacking(said, Reaction.MEMORY_TIER) == "its loop (hf) does not support it"
    assert loop_support.summary(said) == "pause, hang by beat (not: checkpoint, memory tier)"


def test_a_spike_on_a_loop_that_cannot_pause_is_unheeded_once_and_forgotten_when_closed() -> None:
    plain = script()
    cond = spike_condition()
    [unheeded] = policy.on_condition(plain, cond)
    assert isinstance(unheeded, actions.Unheeded) and unheeded.opened
    assert unheeded.reaction == "pause" and "ringmaster.rank" in unheeded.why
    plain.unheeded = [cond.key]
    assert policy.on_condition(plain, cond) == []  # the same fault again: nothing new
    closed = spike_condition()
    closed.active = False
    assert policy.on_condition(plain, closed) == [
        actions.Unheeded(cond.key, "pause", "", "", opened=False)
    ]
    assert plain.pause_reasons == []


def test_an_evacuation_of_a_loop_that_cannot_checkpoint_does_not_wait_for_one() -> None:
    from proto.conditions import Condition, ConditionKind

    notice = Condition(kind=ConditionKind.PREEMPTION, node="node-1", subject="spot")
    [restart] = policy.on_condition(script(), notice)
    assert isinstance(restart, actions.RestartJob) and not restart.graceful
    assert "no checkpoint first" in restart.reason
    [restart] = policy.on_condition(script(list(Reaction)), notice)
    assert isinstance(restart, actions.RestartJob) and restart.graceful


async def test_pause_and_checkpoint_are_refused_with_the_reason_until_the_loop_says() -> None:
    c = Cluster()
    m = c.leader()
    reply = await m.submit(SubmitJob(spec=entry_spec(), workdir="/w"))
    job = m.jobs[reply.job]
    await m.start_pending(job)
    assert job.state is JobState.RUNNING  # a script that said nothing runs from its launch
    for action in ("pause", "checkpoint"):
        refused = await m.control(JobControl(job=job.id, action=action))
        assert not refused.ok and refused.error.startswith(f"job {job.id} cannot {action}: ")
        assert "ringmaster.rank" in refused.error
    assert not c.agents.commands(Pause) and not c.agents.commands(CheckpointNow)
    assert job.state is JobState.RUNNING and job.pause_reasons == []
    # the spike is said once, and the job trains on
    await m.on_event(spike("node-1", "nvme0n1"))
    await m.on_event(spike("node-1", "nvme0n1"))
    unheeded = [e for e in c.events if isinstance(e, JobUnheeded)]
    assert len(unheeded) == 1 and "not paused, it trains on" in unheeded[0].message
    assert job.state is JobState.RUNNING and not c.agents.commands(Pause)
    await m.on_event(spike("node-1", "nvme0n1", active=False))
    assert job.unheeded == []
    # once rank 0 opens the API, the job has what it says
    await rank0(m, LoopReady(job=job.id, framework="hf", reactions=list(Reaction)))
    said = [e for e in c.events if isinstance(e, JobLoop)]
    assert said and said[-1].reactions == [r.value for r in Reaction] and not said[-1].lacks
    assert (await m.control(JobControl(job=job.id, action="pause"))).ok
    assert len(c.agents.commands(Pause, "node-0")) == 1


async def test_a_stop_of_a_script_that_cannot_stop_at_a_step_terminates_without_grace() -> None:
    c = Cluster()
    m = c.leader()
    reply = await m.submit(SubmitJob(spec=entry_spec(), workdir="/w"))
    job = m.jobs[reply.job]
    await m.start_pending(job)
    assert (await m.control(JobControl(job=job.id, action="stop"))).ok
    await m.settle()
    stops = c.agents.commands(Stop)
    assert stops and all(s.force for s in stops)


async def test_a_script_that_reports_no_steps_has_an_unknown_ledger_and_restart_point() -> None:
    c = Cluster()
    m = c.leader()
    reply = await m.submit(SubmitJob(spec=entry_spec(), workdir="/w"))
    job = m.jobs[reply.job]
    await m.start_pending(job)
    start = c.clock.time()
    goodput.account(job, start)
    goodput.account(job, start + 10.0)
    assert job.goodput["productive"] == 0.0
    assert job.goodput["unknown"] == pytest.approx(10.0 * job.world_size)
    await m.on_event(exited(job, 1, 1))
    await m.settle()
    recovering = [e for e in c.events if isinstance(e, JobRecovering)]
    assert recovering
    await m.start_pending(job)
    restarted = [e for e in c.events if isinstance(e, JobRestarted)]
    assert restarted and "script's own checkpoints" in restarted[-1].message


async def test_time_in_a_named_phase_is_the_phase_s_up_to_its_bound() -> None:
    c = Cluster()
    m = c.leader()
    reply = await m.submit(SubmitJob(spec=entry_spec(), workdir="/w"))
    job = m.jobs[reply.job]
    await m.start_pending(job)
    await rank0(m, LoopReady(job=job.id, framework="custom", reactions=list(Reaction)))
    now = c.clock.time()  # stamps lie in the past: a report is never from the future
    await rank0(m, StepDone(job=job.id, step=1, time=now - 21.0))
    await rank0(m, PhaseChanged(job=job.id, name="eval", entered=True, bound_s=30.0, time=now - 20))
    assert job.phase is not None and job.phase.name == "eval"
    job.accounted_at, before = now - 20.0, dict(job.goodput)
    goodput.account(job, now)  # 20 s of evaluation, under its 30 s bound
    assert job.phases["eval"] == pytest.approx(20.0 * job.world_size, abs=0.1)
    goodput.account(job, now + 20.0)  # past the bound: nothing trains, recovery
    assert job.phases["eval"] == pytest.approx(30.0 * job.world_size, abs=0.1)
    recovery = job.goodput["recovery"] - before.get("recovery", 0.0)
    assert recovery == pytest.approx(10.0 * job.world_size, abs=0.1)
    assert job.goodput["productive"] == before.get("productive", 0.0)
    await rank0(m, PhaseChanged(job=job.id, name="eval", entered=False, time=now + 19))
    assert job.phase is None
