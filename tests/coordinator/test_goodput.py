"""The goodput ledger: every GPU-second in exactly one bucket."""

from __future__ import annotations

from coordinator.goodput import account, charge_lost_work, move_stall
from proto.job import GOODPUT_BUCKETS, JobRecord, JobSection, JobSpec, JobState


def job(state: JobState, **kw: object) -> JobRecord:
    return JobRecord(
        id="j", name="j", spec=JobSpec(job=JobSection(name="j")), state=state, world_size=4, **kw
    )  # type: ignore[arg-type]


def test_time_goes_to_the_bucket_of_the_state_times_world_size() -> None:
    j = job(JobState.STARTING)
    account(j, 100.0)
    assert set(j.goodput) == set(GOODPUT_BUCKETS) and sum(j.goodput.values()) == 0
    account(j, 102.0)
    j.state = JobState.RUNNING
    account(j, 105.0)
    j.state = JobState.PAUSED
    account(j, 106.5)
    assert j.goodput["startup"] == 8.0
    assert j.goodput["productive"] == 12.0
    assert j.goodput["paused"] == 6.0


def test_relaunch_after_a_fault_counts_as_recovery() -> None:
    j = job(JobState.STARTING, restarts=1)
    account(j, 10.0)
    account(j, 11.0)
    assert j.goodput["recovery"] == 4.0 and j.goodput["startup"] == 0.0


def test_checkpoint_stall_and_lost_work_move_out_of_productive() -> None:
    j = job(JobState.RUNNING)
    j.goodput = {b: 0.0 for b in GOODPUT_BUCKETS} | {"productive": 100.0}
    move_stall(j, 2.0)
    assert j.goodput["productive"] == 92.0 and j.goodput["checkpoint_stall"] == 8.0
    j.failed_at_step = 46  # 2 GPU-s per step so far
    charge_lost_work(j, resumed_at_step=40)
    assert j.goodput["lost_work"] == 12.0 and j.goodput["productive"] == 80.0
    total = sum(j.goodput.values())
    assert total == 100.0  # moved, never created
