"""Fault policy is a pure function: events in, actions out, no I/O."""

from __future__ import annotations

import pytest

from coordinator import policy
from proto.events import (
    ClockDrift,
    ClockResynced,
    GpuThermal,
    NodeLost,
    NvmeLatencyRecovered,
    NvmeLatencySpike,
    NvmeReadonly,
    SpotNotice,
    WorkerExited,
)
from proto.job import JobRecord, JobSection, JobSpec, JobState


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


def spike(node: str = "node-1", lat: float = 500.0) -> NvmeLatencySpike:
    return NvmeLatencySpike(node=node, device="nvme0n1", latency_us=lat)


def test_spike_on_a_hosting_node_pauses() -> None:
    [action] = policy.decide(job(), spike())
    assert action == policy.PauseJob("nvme:node-1:nvme0n1", "NVMe nvme0n1 on node-1 at 500 µs")


def test_spike_elsewhere_or_below_the_job_threshold_does_nothing() -> None:
    assert policy.decide(job(), spike(node="node-7")) == []
    assert policy.decide(job(), spike(lat=90.0)) == []
    custom = job()
    custom.spec.policy.nvme_pause_us = 1000.0
    assert policy.decide(custom, spike()) == []


def test_finished_jobs_ignore_faults() -> None:
    for state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED, JobState.PENDING):
        assert policy.decide(job(state), spike()) == []


def test_recovery_resumes_by_the_same_key() -> None:
    event = NvmeLatencyRecovered(node="node-1", device="nvme0n1", latency_us=20.0)
    [action] = policy.decide(job(JobState.PAUSED), event)
    assert isinstance(action, policy.ResumeJob) and action.key == "nvme:node-1:nvme0n1"


def test_pause_reasons_are_reference_counted() -> None:
    reasons, first = policy.open_reason([], "a")
    assert first and reasons == ["a"]
    reasons, first = policy.open_reason(reasons, "b")
    assert not first
    reasons, again = policy.open_reason(reasons, "b")
    assert not again and reasons == ["a", "b"]
    reasons, last = policy.close_reason(reasons, "a")
    assert not last and reasons == ["b"]
    reasons, last = policy.close_reason(reasons, "zzz")
    assert not last
    reasons, last = policy.close_reason(reasons, "b")
    assert last and reasons == []


def test_failed_rank_restarts_within_budget_then_fails() -> None:
    exit_ = WorkerExited(node="node-0", job="t-1", rank=0, exit_code=1, attempt=1)
    [action] = policy.decide(job(), exit_)
    assert isinstance(action, policy.RestartJob) and action.exclude == ()
    [action] = policy.decide(job(restarts=3), exit_)
    assert isinstance(action, policy.FinishJob) and action.state is JobState.FAILED


def test_exits_from_an_earlier_attempt_are_ignored() -> None:
    stale = WorkerExited(node="node-0", job="t-1", rank=0, exit_code=-9, attempt=0)
    assert policy.decide(job(), stale) == []


def test_clean_exits_complete_only_when_every_rank_is_done() -> None:
    done = WorkerExited(node="node-0", job="t-1", rank=0, exit_code=0, attempt=1)
    assert policy.decide(job(step=100, exited_ranks={"0": 0}), done) == []
    [action] = policy.decide(job(step=100, exited_ranks={"0": 0, "1": 0}), done)
    assert action == policy.FinishJob(JobState.COMPLETED, "reached step 100")


def test_clean_exit_before_the_target_waits_for_progress_then_fails() -> None:
    early = job(step=50, exited_ranks={"0": 0, "1": 0})
    done = WorkerExited(node="node-0", job="t-1", rank=0, exit_code=0, attempt=1)
    assert policy.decide(early, done) == []
    [action] = policy.overdue(early)
    assert isinstance(action, policy.FinishJob) and action.state is JobState.FAILED
    early.finished = "completed"
    assert policy.decide(early, done)[0].state is JobState.COMPLETED  # type: ignore[union-attr]


def test_stop_requested_ends_stopped() -> None:
    stopping = job(stopping=True, step=10, exited_ranks={"0": -15, "1": -15}, reason="stop")
    exit_ = WorkerExited(node="node-1", job="t-1", rank=1, exit_code=None, signal=15, attempt=1)
    [action] = policy.decide(stopping, exit_)
    assert action == policy.FinishJob(JobState.STOPPED, "stop")


@pytest.mark.parametrize(
    "event",
    [
        NvmeReadonly(node="node-1", device="nvme0n1", readonly=True),
        SpotNotice(node="node-1", provider="aws"),
        GpuThermal(node="node-1", gpu=3, temp_c=95.0),
    ],
)
def test_node_ending_faults_checkpoint_drain_and_restart_without_the_node(event) -> None:  # type: ignore[no-untyped-def]
    actions = policy.decide(job(), event)
    kinds = [type(a) for a in actions]
    assert kinds == [policy.CheckpointJob, policy.DrainNode, policy.RestartJob]
    assert actions[1].node == "node-1"  # type: ignore[union-attr]
    assert actions[2].exclude == ("node-1",)  # type: ignore[union-attr]


def test_warm_gpu_below_critical_is_not_a_reason_to_drain() -> None:
    assert policy.decide(job(), GpuThermal(node="node-1", gpu=0, temp_c=86.0)) == []


def test_lost_node_drains_and_restarts_without_it() -> None:
    actions = policy.decide(job(), NodeLost(node="node-0"))
    assert actions == [
        policy.DrainNode("node-0", "heartbeat lost"),
        policy.RestartJob("node node-0 lost", ("node-0",)),
    ]


def test_a_hardware_thermal_slowdown_is_critical_below_the_threshold() -> None:
    slow = GpuThermal(
        node="node-1", gpu=2, temp_c=80.0, level="critical", reasons=["hw_thermal_slowdown"]
    )
    actions = policy.decide(job(), slow)
    assert [type(a) for a in actions] == [policy.CheckpointJob, policy.DrainNode, policy.RestartJob]
    cooled = GpuThermal(node="node-1", gpu=2, temp_c=95.0, level="normal")
    assert policy.decide(job(), cooled) == []


def test_clock_drift_resyncs_and_a_failed_resync_drains() -> None:
    drift = ClockDrift(node="node-3", offset_ms=12.0, synced=True)
    assert policy.decide_node(drift) == [policy.ResyncNode("node-3", "clock 12.0 ms off")]
    unsynced = ClockDrift(node="node-3", synced=False)
    assert policy.decide_node(unsynced)[0].reason == "clock unsynchronised"  # type: ignore[union-attr]
    assert policy.decide_node(ClockDrift(node="node-3", recovered=True)) == []
    failed = ClockResynced(node="node-1", ok=False, offset_after_ms=9.5)
    actions = policy.decide(job(), failed)
    assert [type(a) for a in actions] == [policy.DrainNode, policy.RestartJob]
    assert policy.decide(job(), ClockResynced(node="node-1", ok=True)) == []


def test_a_crash_during_teardown_after_the_end_is_not_a_restart() -> None:
    finished = job(step=100, finished="completed", exited_ranks={"0": 0, "1": -6})
    crash = WorkerExited(node="node-1", job="t-1", rank=1, exit_code=None, signal=6, attempt=1)
    assert policy.decide(finished, crash) == [
        policy.FinishJob(JobState.COMPLETED, "reached step 100")
    ]
