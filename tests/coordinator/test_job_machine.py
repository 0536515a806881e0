"""Every row of the job state machine's table, driven through the job manager's real
input paths over the in-memory store and fake agents, each with a leader change in the
middle: the deposed leader decides the same input from its stale copy and loses the
compare-and-set (nothing of it reaches the store), then its successor takes the input and
the stored record moves as the row says. Plus the budget, and the docs' copy of the table.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from test_jobs import Cluster, exited, rank0, spec

from coordinator import job_machine
from coordinator.cas import Conflict
from coordinator.job_machine import PA, RE, TABLE, C, Input, P, R, S
from coordinator.jobs import JobManager
from proto.api import JobControl, SubmitJob
from proto.events import WorkerExited
from proto.job import Failure, JobRecord, JobState
from proto.node import Heartbeat, RankReport
from proto.progress import Checkpointed, Finished, Paused, Resumed, StepDone

pytestmark = pytest.mark.anyio
Drive = Callable[[Cluster, JobManager, str], Awaitable[None]]


async def reach(c: Cluster, m: JobManager, state: JobState, *, stopping: bool = False) -> str:
    """A job in ``state`` through the real paths; ``stopping``: a recovering job whose
    given-up attempt is still being stopped."""
    s = spec(2)
    s.policy.max_restarts = 1
    job = m.jobs[(await m.submit(SubmitJob(spec=s, workdir="/w"))).job]
    if state is not P:
        await m.start_pending(job)
    if state in (R, PA, C, RE):
        await rank0(m, StepDone(job=job.id, step=1, loss=5.0))
    if state is PA:
        await m.control(JobControl(job=job.id, action="pause"))
        await rank0(m, Paused(job=job.id, step=1))
    if state is C:
        await m.control(JobControl(job=job.id, action="checkpoint"))
    if state is RE:
        await m.on_event(exited(job, 1, 1))
        if not stopping:
            await m.settle()
    await m.flush()
    assert job.state is state and bool(job.stopping_attempt) == stopping
    return job.id


async def launch(c: Cluster, m: JobManager, job: str) -> None:
    await m.start_pending(m.jobs[job])


async def undo_launch(c: Cluster, m: JobManager, job: str) -> None:
    c.agents.failing["node-1"] = "no GPUs"
    await m.start_pending(m.jobs[job])


async def step(c: Cluster, m: JobManager, job: str) -> None:
    await rank0(m, StepDone(job=job, step=2, loss=4.0))


async def paused(c: Cluster, m: JobManager, job: str) -> None:
    await rank0(m, Paused(job=job, step=1))


async def resumed(c: Cluster, m: JobManager, job: str) -> None:
    await m.control(JobControl(job=job, action="resume"))
    await rank0(m, Resumed(job=job, step=1))


async def checkpoint(c: Cluster, m: JobManager, job: str) -> None:
    await m.control(JobControl(job=job, action="checkpoint"))


async def checkpointed(c: Cluster, m: JobManager, job: str) -> None:
    await rank0(m, Checkpointed(job=job, step=1, path="/w/step-1"))


async def fault(c: Cluster, m: JobManager, job: str) -> None:
    await m.on_event(exited(m.jobs[job], 1, 1))


async def attempt_stopped(c: Cluster, m: JobManager, job: str) -> None:
    await m.load()  # a new leader takes the stop up again; its end is the input
    await m.settle()


async def stop(c: Cluster, m: JobManager, job: str) -> None:
    c.agents.down.update({"node-0", "node-1"})  # nobody confirms: the stop stays under way
    await m.control(JobControl(job=job, action="stop"))


async def stopped(c: Cluster, m: JobManager, job: str) -> None:
    await m.control(JobControl(job=job, action="stop"))
    await m.settle()


async def complete(c: Cluster, m: JobManager, job: str) -> None:
    record = m.jobs[job]
    await rank0(m, Finished(job=job, step=record.target_steps, outcome="completed"))
    for rank in range(record.world_size):
        await m.on_event(exited(record, rank, 0))


async def fail(c: Cluster, m: JobManager, job: str) -> None:
    record = m.jobs[job]
    record.waiting_since = 1.0  # waited far beyond wait_for_nodes_s ...
    if record.state in (S, R, PA, C):  # ... or, running, a crash loop past the budget
        record.restarts_in_row = 1
        record.last_failure = Failure(node="node-1", rank=1, cause="exit 1", step=1)
        await fault(c, m, job)
    else:
        await m.tick()


DRIVERS: dict[Input, Drive] = {
    Input.LAUNCH: launch,
    Input.UNDO_FIRST_LAUNCH: undo_launch,
    Input.UNDO_RELAUNCH: undo_launch,
    Input.TRAINING: step,
    Input.PAUSED: paused,
    Input.RESUMED: resumed,
    Input.CHECKPOINT: checkpoint,
    Input.CHECKPOINTED: checkpointed,
    Input.FAULT: fault,
    Input.ATTEMPT_STOPPED: attempt_stopped,
    Input.STOP: stop,
    Input.STOPPED: stopped,
    Input.COMPLETE: complete,
    Input.FAIL: fail,
}
# Rows whose source state lasts only inside one call: reached from where that call starts.
STARTS_FROM = {Input.UNDO_FIRST_LAUNCH: P, Input.UNDO_RELAUNCH: RE}


@pytest.mark.parametrize(("state", "what"), sorted(TABLE), ids=lambda v: str(v))
async def test_every_row_with_a_leader_change_in_the_middle(state: JobState, what: Input) -> None:
    c = Cluster(nodes=3)
    old = c.leader("c-0", epoch=1)
    start = STARTS_FROM.get(what, state)
    job = await reach(c, old, start, stopping=what is Input.ATTEMPT_STOPPED)
    new = c.leader("c-1", epoch=2)
    await new.load()
    await new.settle()  # what the successor took up on load (a stop) is done
    new.jobs[job] = await c.stored(job)  # its copy as the store has it now
    await new.table.save(new.jobs[job])  # the successor writes first: the old copy is stale
    before = (await c.stored(job)).state
    with contextlib.suppress(Conflict):
        await DRIVERS[what](c, old, job)
        await old.settle()
        await old.flush()
    assert (await c.stored(job)).state is before, "a deposed leader's transition was saved"
    if what is Input.ATTEMPT_STOPPED:
        assert before is RE  # the successor already finished the stop on taking over
        return
    c.agents.down.clear()
    c.agents.failing.clear()
    await DRIVERS[what](c, new, job)
    await new.flush()
    assert (await c.stored(job)).state is TABLE[(state, what)].next


def test_inputs_without_a_row_change_nothing() -> None:
    job = JobRecord(id="j", name="j", spec=spec(2), state=JobState.COMPLETED)
    for what in Input:
        assert job_machine.fire(job, what) is None and job.state is JobState.COMPLETED
    job.state = JobState.PAUSED
    assert job_machine.fire(job, Input.CHECKPOINTED) is None and job.state is JobState.PAUSED


async def test_a_missed_exit_is_found_by_reconciliation_within_a_beat() -> None:
    """Rank 1's worker.exited never arrives; node-1's next beat reports it exited 1."""
    c = Cluster()
    m = c.leader()
    job_id = await reach(c, m, R)
    job = m.jobs[job_id]
    m.launcher.launched_at[job_id] = (job.attempt, -1e9)  # launched long before the beat
    ranks = {
        "node-0": RankReport(job=job_id, rank=0, attempt=job.attempt, pid=10_000, alive=True),
        "node-1": RankReport(
            job=job_id, rank=1, attempt=job.attempt, pid=10_001, alive=False, exit_code=1
        ),
    }

    def beat_after(seconds: float) -> None:
        """Every node beats ``seconds`` on, listing its rank as above."""
        c.clock.advance(seconds)
        for node, report in ranks.items():
            beat = Heartbeat(node=node, seq=2, sent_at=c.clock.time(), gpus=1, ranks=[report])
            c.registry.observe(beat, c.clock.monotonic())

    beat_after(1.0)  # the first beats since the launch was answered
    await m.tick()  # the agent's own event, sent first, may still be on its way
    assert job.state is not RE and "worker.exited" not in c.kinds()
    beat_after(1.0)
    await m.tick()
    assert job.state is not RE  # listed for one beat: still not missed
    beat_after(1.0)  # a beat and a half: missed
    await m.tick()
    assert job.state is RE and job.restarts == 1
    assert "from node-1's rank report" in job.reason
    await m.tick()  # the same report again: the same fact, no second restart
    assert job.restarts == 1 and c.kinds().count("worker.exited") == 1


async def test_an_exit_listed_in_a_beat_before_its_event_arrives_is_recorded_once() -> None:
    """The beat that lists rank 1's exit reaches the leader before the agent's own
    worker.exited (beats and events travel apart): one event in the history, one restart."""
    c = Cluster()
    m = c.leader()
    job_id = await reach(c, m, R)
    job = m.jobs[job_id]
    m.launcher.launched_at[job_id] = (job.attempt, -1e9)

    def beat_after(seconds: float) -> None:
        c.clock.advance(seconds)
        for r, alive in ((0, True), (1, False)):
            report = RankReport(
                job=job_id, rank=r, attempt=job.attempt, pid=10_000 + r, alive=alive, exit_code=1
            )
            beat = Heartbeat(
                node=f"node-{r}", seq=2, sent_at=c.clock.time(), gpus=1, ranks=[report]
            )
            c.registry.observe(beat, c.clock.monotonic())

    beat_after(1.0)
    await m.tick()
    exited = WorkerExited(node="node-1", job=job_id, rank=1, attempt=job.attempt, exit_code=1)
    c.events.append(exited)  # the agent's event, a beat late
    await m.on_event(exited)
    for _ in range(2):  # the beats list it on, past a beat and a half
        beat_after(1.0)
        await m.tick()
    await m.settle()
    assert job.restarts == 1 and c.kinds().count("worker.exited") == 1, c.kinds()


def table_in_docs() -> set[tuple[str, str, str]]:
    text = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| `(\w+)` \|", text, flags=re.M)
    return set(rows)


def test_the_docs_list_exactly_the_tables_rows() -> None:
    rows = {(s.value, i.value, row.next.value) for (s, i), row in TABLE.items()}
    assert table_in_docs() == rows


def failure(node: str, rank: int | None = 1, cause: str = "exit 1", at: int = 10) -> Failure:
    return Failure(node=node, rank=rank, cause=cause, step=at)


def test_the_budget_counts_a_repeated_cause_and_names_it() -> None:
    job = JobRecord(id="j", name="j", spec=spec(2), step=10)
    for _ in range(3):  # max_restarts = 3: three restarts of the same failure ...
        assert job_machine.charge(job, failure("node-1"), ()) is None
    spent = job_machine.charge(job, failure("node-1"), ())  # ... and the fourth fails
    assert spent is not None and "rank 1 on node-1: exit 1 near step 10" in spent


def test_distinct_faults_and_nodes_left_out_do_not_spend_the_budget() -> None:
    """A rank killed, a node lost, the master's node lost, a rank stopped: four causes."""
    job = JobRecord(id="j", name="j", spec=spec(2), step=10)
    faults = [
        (failure("node-1", 1, "signal 9"), ()),
        (failure("node-2", None, "node lost"), ("node-2",)),
        (failure("node-0", None, "node lost"), ("node-0",)),
        (failure("node-3", 1, "hang"), ()),
        (failure("node-1", 0, "exit 1", at=500), ()),  # node-1 again, far from its last
    ]
    for f, left_out in faults:
        assert job_machine.charge(job, f, left_out) is None
    assert job.restarts_in_row == 1  # node-1 twice, but not in a row


def test_training_past_the_failures_ends_the_loop() -> None:
    job = JobRecord(id="j", name="j", spec=spec(2), step=10)
    for _ in range(3):
        assert job_machine.charge(job, failure("node-1"), ()) is None
    job_machine.trained_to(job, 11)
    assert job.restarts_in_row == 0 and job.last_failure is None
    assert job_machine.charge(job, failure("node-1"), ()) is None
