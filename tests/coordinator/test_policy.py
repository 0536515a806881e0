"""Fault policy is pure: conditions and events in, actions out, no I/O."""

from __future__ import annotations

import pytest

from coordinator import actions, placement_policy, policy, progress_policy
from proto.conditions import Condition, ConditionKind, Severity, condition_key
from proto.events import (
    ClockResynced,
    ClockResyncFailed,
    NodeAway,
    NodeLost,
    NvmeLatencySpike,
    WorkerExited,
)
from proto.job import Allocation, Exclusion, Failure, JobRecord, JobSection, JobSpec, JobState


def job(state: JobState = JobState.RUNNING, **kw: object) -> JobRecord:
    spec = JobSpec(job=JobSection(name="t", nodes=2))
    base: dict[str, object] = dict(
        id="t-1",
        name="t",
        spec=spec,
        state=state,
        nodes=["node-0", "node-1"],
        world_size=2,
        target_steps=100,
        attempt=1,
    )
    base.update(kw)
    return JobRecord(**base)  # type: ignore[arg-type]


def spike(node: str = "node-1", dev: str = "nvme0n1", lat: float = 500.0) -> Condition:
    return Condition(kind=ConditionKind.NVME_LATENCY, node=node, subject=dev, value=lat)


def closed(cond: Condition) -> Condition:
    return Condition(
        kind=cond.kind, node=cond.node, job=cond.job, subject=cond.subject, active=False
    )


def operator(active: bool = True) -> Condition:
    return Condition(kind=ConditionKind.OPERATOR, job="t-1", active=active)


def apply(record: JobRecord, decided: list[actions.Action]) -> None:
    """What the job manager does with pause reasons, so sequences can be followed."""
    for action in decided:
        if isinstance(action, actions.PauseJob | actions.ResumeJob):
            record.pause_reasons = list(action.reasons)


def test_a_spike_on_a_hosting_node_pauses_under_the_condition_key() -> None:
    [action] = policy.on_condition(job(), spike())
    key = condition_key(ConditionKind.NVME_LATENCY, "node-1", "nvme0n1")
    assert action == actions.PauseJob(key, "NVMe nvme0n1 on node-1 at 500 µs", (key,), send=True)


def test_the_event_carrying_a_condition_is_decided_by_its_condition() -> None:
    event = NvmeLatencySpike(node="node-1", device="nvme0n1", latency_us=500.0, condition=spike())
    assert policy.decide(job(), event) == policy.on_condition(job(), spike())
    bare = NvmeLatencySpike(node="node-1", device="nvme0n1", latency_us=500.0)
    assert policy.decide(job(), bare) == []  # no condition, no evidence to act on


def test_a_spike_elsewhere_does_nothing() -> None:
    assert policy.on_condition(job(), spike(node="node-7")) == []
    # left out by a restart: the job recovers without it until the next attempt launches
    assert policy.on_condition(job(JobState.RECOVERING), spike()) == []


def test_the_agent_judged_the_spike_so_any_open_latency_condition_pauses() -> None:
    """The threshold is the agent's nvme.spike_us: the job has no second one to re-check
    (the condition is not restated as latency changes, so a re-check could never pause)."""
    key = condition_key(ConditionKind.NVME_LATENCY, "node-1", "nvme0n1")
    [action] = policy.on_condition(job(), spike(lat=90.0))
    assert action == actions.PauseJob(key, "NVMe nvme0n1 on node-1 at 90 µs", (key,), send=True)
    bare = Condition(kind=ConditionKind.NVME_LATENCY, node="node-1", subject="nvme0n1")
    [action] = policy.on_condition(job(), bare)
    assert isinstance(action, actions.PauseJob) and action.reason == "NVMe nvme0n1 on node-1"


def test_finished_jobs_ignore_conditions() -> None:
    for state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED):
        assert policy.on_condition(job(state), spike()) == []
        assert policy.on_condition(job(state, pause_reasons=[spike().key]), closed(spike())) == []
    assert policy.on_condition(job(JobState.PENDING), spike()) == []


def test_two_devices_resume_only_when_the_last_recovers() -> None:
    record = job()
    a, b = spike(dev="nvme0n1"), spike(dev="nvme1n1")
    first = policy.on_condition(record, a)
    apply(record, first)
    second = policy.on_condition(record, b)
    apply(record, second)
    assert [x.send for x in first + second] == [True, False]  # type: ignore[union-attr]
    assert record.pause_reasons == [a.key, b.key]
    assert policy.on_condition(record, a) == []  # the same condition again: nothing new
    record.state = JobState.PAUSED
    one = policy.on_condition(record, closed(a))
    apply(record, one)
    assert one == [actions.ResumeJob(a.key, f"{a.key} closed", (b.key,), send=False)]
    last = policy.on_condition(record, closed(b))
    assert last == [actions.ResumeJob(b.key, f"{b.key} closed", (), send=True)]


def test_an_operator_pause_during_a_spike_holds_until_both_close() -> None:
    record = job()
    apply(record, policy.on_condition(record, spike()))
    [held] = policy.on_condition(record, operator())
    assert isinstance(held, actions.PauseJob) and not held.send  # already paused by the spike
    assert held.key == condition_key(ConditionKind.OPERATOR, job="t-1")
    apply(record, [held])
    record.state = JobState.PAUSED
    [spike_over] = policy.on_condition(record, closed(spike()))
    assert isinstance(spike_over, actions.ResumeJob) and not spike_over.send
    apply(record, [spike_over])
    [released] = policy.on_condition(record, operator(active=False))
    assert isinstance(released, actions.ResumeJob) and released.send and released.reasons == ()


def test_an_operator_condition_concerns_its_own_job_only() -> None:
    other = Condition(kind=ConditionKind.OPERATOR, job="t-2")
    assert policy.on_condition(job(), other) == []


def test_closing_a_reason_while_recovering_releases_it_without_a_command() -> None:
    record = job(JobState.RECOVERING, pause_reasons=[spike().key])
    [action] = policy.on_condition(record, closed(spike()))
    assert action == actions.ResumeJob(spike().key, f"{spike().key} closed", (), send=False)


def test_a_relaunch_keeps_reasons_still_open_and_repauses() -> None:
    elsewhere = spike(node="node-1")
    op = operator()
    record = job(
        JobState.STARTING, nodes=["node-0", "node-2"], pause_reasons=[elsewhere.key, op.key]
    )
    decided = policy.relaunched(record, active={})
    assert decided == [
        actions.ResumeJob(elsewhere.key, "not on this attempt's nodes", (op.key,), send=False),
        actions.PauseJob(op.key, f"held by {op.key}", (op.key,), send=True),
    ]
    assert policy.relaunched(job(JobState.STARTING), active={}) == []


def test_a_failed_rank_restarts_naming_what_failed_for_the_budget() -> None:
    exit_ = WorkerExited(node="node-0", job="t-1", rank=0, exit_code=1, attempt=1)
    [action] = policy.decide(job(step=40), exit_)
    assert isinstance(action, actions.RestartJob) and action.exclude == ()
    assert action.failure == Failure(node="node-0", rank=0, cause="exit 1", step=40)
    killed = WorkerExited(node="node-0", job="t-1", rank=0, signal=9, attempt=1)
    [action] = policy.decide(job(), killed)
    assert isinstance(action, actions.RestartJob) and action.failure is not None
    assert action.failure.cause == "signal 9"  # the budget is counted by the machine


def test_exits_from_an_earlier_attempt_are_ignored() -> None:
    stale = WorkerExited(node="node-0", job="t-1", rank=0, exit_code=-9, attempt=0)
    assert policy.decide(job(), stale) == []


def test_clean_exits_complete_only_when_every_rank_is_done() -> None:
    done = WorkerExited(node="node-0", job="t-1", rank=0, exit_code=0, attempt=1)
    said = {"finished": "completed"}
    assert policy.decide(job(step=100, exited_ranks={"0": 0}, **said), done) == []
    [action] = policy.decide(job(step=100, exited_ranks={"0": 0, "1": 0}, **said), done)
    assert action == actions.FinishJob(JobState.COMPLETED, "reached step 100")


def test_clean_exit_before_the_target_waits_for_progress_then_fails() -> None:
    early = job(step=50, exited_ranks={"0": 0, "1": 0})
    done = WorkerExited(node="node-0", job="t-1", rank=0, exit_code=0, attempt=1)
    assert policy.decide(early, done) == []
    [action] = progress_policy.overdue(early)
    assert isinstance(action, actions.FinishJob) and action.state is JobState.FAILED
    early.finished = "completed"
    assert policy.decide(early, done)[0].state is JobState.COMPLETED  # type: ignore[union-attr]


def test_stop_requested_ends_stopped() -> None:
    stopping = job(stopping=True, step=10, exited_ranks={"0": -15, "1": -15}, reason="stop")
    exit_ = WorkerExited(node="node-1", job="t-1", rank=1, exit_code=None, signal=15, attempt=1)
    [action] = policy.decide(stopping, exit_)
    assert action == actions.FinishJob(JobState.STOPPED, "stop")


@pytest.mark.parametrize(
    "cond",
    [
        Condition(kind=ConditionKind.NVME_READONLY, node="node-1", subject="nvme0n1"),
        Condition(kind=ConditionKind.PREEMPTION, node="node-1", subject="aws"),
        Condition(
            kind=ConditionKind.GPU_THERMAL,
            node="node-1",
            subject="3",
            value=95.0,
            severity=Severity.CRITICAL,
        ),
    ],
)
def test_node_ending_conditions_drain_and_restart_gracefully_without_the_node(
    cond: Condition,
) -> None:
    # the node drains by its critical condition itself (coordinator.node_life)
    [restart] = policy.on_condition(job(), cond)
    # graceful: the ranks checkpoint at the next boundary and resume from exactly there
    assert isinstance(restart, actions.RestartJob) and restart.graceful
    assert restart.exclude == ("node-1",) and restart.failure is not None
    assert restart.failure.node == "node-1"  # left out: it spends no budget


def test_a_gpu_the_agent_rates_a_warning_is_not_a_reason_to_drain() -> None:
    """Critical is the agent's gpu.critical_c: a warning is no drain at any temperature."""
    for temp in (86.0, 95.0):
        warm = Condition(kind=ConditionKind.GPU_THERMAL, node="node-1", subject="0", value=temp)
        assert warm.severity is Severity.WARNING
        assert policy.on_condition(job(), warm) == []


def test_a_hardware_thermal_slowdown_is_critical_below_the_threshold() -> None:
    slow = Condition(
        kind=ConditionKind.GPU_THERMAL,
        node="node-1",
        subject="2",
        value=80.0,
        severity=Severity.CRITICAL,
        reason="GPU 2 critical: 80 °C, hw_thermal_slowdown",
    )
    [restart] = policy.on_condition(job(), slow)
    assert isinstance(restart, actions.RestartJob)
    assert "hw_thermal_slowdown" in restart.reason
    assert policy.on_condition(job(), closed(slow)) == []


def test_an_away_node_whose_ranks_stopped_is_lost_and_left_out() -> None:
    decided = policy.decide(job(), NodeAway(node="node-0"))
    assert decided == [
        actions.DeclareLost("node-0", "the ranks of t-1 stopped stepping"),
        actions.RestartJob(
            "node node-0 lost", ("node-0",), Failure(node="node-0", cause="node lost")
        ),
    ]


def test_an_away_node_whose_ranks_still_step_is_neither_lost_nor_restarted() -> None:
    assert policy.decide(job(), NodeAway(node="node-0"), progressing=True) == []
    # node.lost is the verdict's consequence, never a second cause
    assert policy.decide(job(), NodeLost(node="node-0")) == []


def test_a_script_reporting_no_steps_waits_out_the_grace_of_its_away_node() -> None:
    # its ranks outlive a restarting agent, and no steps can say whether they still run:
    # only the node's grace running out (node.lost) restarts the job
    script = JobSpec(job=JobSection(name="t", nodes=2, entry=["/bin/sh", "-c", "sleep 9"]))
    assert policy.decide(job(spec=script), NodeAway(node="node-0")) == []
    assert policy.decide(job(spec=script), NodeLost(node="node-0")) == [
        actions.RestartJob(
            "node node-0 lost", ("node-0",), Failure(node="node-0", cause="node lost")
        ),
    ]
    assert policy.decide(job(spec=script, nodes=["node-1"]), NodeLost(node="node-0")) == []


def test_clock_drift_resyncs_and_a_failed_resync_drains() -> None:
    drift = Condition(
        kind=ConditionKind.CLOCK, node="node-3", value=12.0, reason="clock +12.00 ms beyond 5 ms"
    )
    assert policy.on_node_condition(drift) == [
        actions.ResyncNode("node-3", "clock +12.00 ms beyond 5 ms")
    ]
    assert policy.on_node_condition(closed(drift)) == []
    assert policy.on_node_condition(spike()) == []
    failed = ClockResyncFailed(node="node-1", offset_after_ms=9.5)
    drain, restart = policy.decide(job(), failed)
    why = "clock on node-1 still +9.5 ms off (limit 5 ms) after a resync"
    assert drain == actions.DrainNode("node-1", "clock.drift:node-1", why)
    assert isinstance(restart, actions.RestartJob) and restart.exclude == ("node-1",)
    assert policy.decide(job(), ClockResynced(node="node-1", offset_after_ms=9.5)) == []


def test_a_failed_resync_without_evidence_kills_nothing() -> None:
    """Seen on a real node without chrony: the kernel says unsynchronised, the measured
    offset is -0.02 ms, the resync fails because chronyc is missing. No drain."""
    no_tool = ClockResyncFailed(node="node-1", offset_after_ms=-0.02)
    assert policy.decide(job(), no_tool) == []
    unmeasured = ClockResyncFailed(node="node-1", offset_measured=False)
    assert policy.decide(job(), unmeasured) == []


def test_completed_needs_rank_0s_word_and_every_rank_exiting_0() -> None:
    """A crash after rank 0's final word is a failure like any other: the restart
    resumes from the final checkpoint and ends at once; only clean exits complete."""
    finished = job(step=100, finished="completed", exited_ranks={"0": 0, "1": -6})
    crash = WorkerExited(node="node-1", job="t-1", rank=1, exit_code=None, signal=6, attempt=1)
    [restart] = policy.decide(finished, crash)
    assert isinstance(restart, actions.RestartJob)
    clean = job(step=100, finished="completed", exited_ranks={"0": 0, "1": 0})
    last = WorkerExited(node="node-1", job="t-1", rank=1, exit_code=0, attempt=1)
    assert policy.decide(clean, last) == [actions.FinishJob(JobState.COMPLETED, "reached step 100")]
    # without rank 0's word the same exits wait (its word may be in flight)
    assert policy.decide(job(step=100, exited_ranks={"0": 0, "1": 0}), last) == []


def test_a_peers_exit_restarts_without_the_silent_node() -> None:
    """A machine dies: its peer's rank exits first (code 1), seconds before the machine's
    heartbeats are declared lost. The one restart leaves the silent node out."""
    peer_exit = WorkerExited(node="node-0", job="t-1", rank=0, exit_code=1, attempt=1)
    [action] = policy.decide(job(), peer_exit, silent=frozenset({"node-1", "node-9"}))
    assert isinstance(action, actions.RestartJob) and action.exclude == ("node-1",)
    assert action.reason.endswith("; node-1 silent, left out")
    [action] = policy.decide(job(), peer_exit)
    assert action == actions.RestartJob(
        f"rank 0 on node-0 failed ({peer_exit.message})",
        (),
        Failure(node="node-0", rank=0, cause="exit 1"),
    )


def test_a_node_that_came_back_after_being_left_out_is_evacuated_again() -> None:
    """Its exclusion record stays (for backoff) once it has ended and the node rejoined."""
    back = job()
    back.excluded = {"node-1": Exclusion(reason="spot", since=0.0, until=1.0)}
    notice = Condition(kind=ConditionKind.PREEMPTION, node="node-1", subject="aws")
    [restart] = policy.on_condition(back, notice)
    assert isinstance(restart, actions.RestartJob) and restart.exclude == ("node-1",)


def test_a_restart_that_cannot_be_placed_inside_an_allocation_stops_to_be_requeued() -> None:
    inside = Allocation(job_id="42", hosts=["node-0", "node-1"])
    waiting = job(JobState.RECOVERING, allocation=inside, waiting_since=1000.0)
    waiting.reason = "waiting for 2 healthy nodes; skipped: node-1: node is lost"
    assert (
        placement_policy.waited_too_long(waiting, 1000.0 + placement_policy.ALLOCATION_WAIT_S - 1)
        == []
    )
    [finish] = placement_policy.waited_too_long(
        waiting, 1000.0 + placement_policy.ALLOCATION_WAIT_S
    )
    assert finish == actions.FinishJob(
        JobState.STOPPED,
        "cannot continue inside Slurm job 42's allocation: waiting for 2 healthy nodes; "
        "skipped: node-1: node is lost; requeue it",
        requeue=True,
    )
    # a first start waits longer (its nodes' agents may still be starting), then the same:
    # an allocation holding a node Ringmaster will not use is not held idle
    first = job(JobState.PENDING, allocation=inside, waiting_since=1000.0)
    first.reason = "waiting for 2 healthy nodes; skipped: node-1: node is draining"
    assert (
        placement_policy.waited_too_long(
            first, 1000.0 + placement_policy.ALLOCATION_START_WAIT_S - 1
        )
        == []
    )
    [stop] = placement_policy.waited_too_long(
        first, 1000.0 + placement_policy.ALLOCATION_START_WAIT_S
    )
    assert stop == actions.FinishJob(
        JobState.STOPPED,
        "cannot start inside Slurm job 42's allocation: waiting for 2 healthy nodes; "
        "skipped: node-1: node is draining; requeue it",
        requeue=True,
    )
    # outside an allocation: the job's own wait_for_nodes_s, then it fails
    outside = job(JobState.RECOVERING, waiting_since=1000.0)
    assert (
        placement_policy.waited_too_long(outside, 1000.0 + placement_policy.ALLOCATION_WAIT_S) == []
    )


def test_an_operators_drain_moves_a_job_off_the_node_checkpoint_first_spending_nothing() -> None:
    [restart] = policy.on_operator_drain(job(), "node-1", "drained by alice: disk swap")
    assert isinstance(restart, actions.RestartJob) and restart.graceful
    assert restart.exclude == () and restart.failure is None  # its drain keeps it out
    assert restart.reason == "node-1 drained: drained by alice: disk swap"
    assert policy.on_operator_drain(job(), "node-7", "elsewhere") == []
    assert policy.on_operator_drain(job(JobState.COMPLETED), "node-1", "done") == []
