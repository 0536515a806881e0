"""The goodput ledger: every GPU-second in exactly one bucket."""

from __future__ import annotations

import pytest

from coordinator.goodput import (
    MAX_LAG_S,
    account,
    began_training,
    charge_detection,
    charge_lost_work,
    move_stall,
    observe_step_time,
    stamp,
    stepped,
    stepped_while_stopping,
)
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


def test_a_checkpoint_costs_its_stall_not_the_time_it_takes_to_become_durable() -> None:
    """Requested at 0 s, durable at 21 s, training blocked 4.7 s of it: 4.7 s is stall."""
    j = JobRecord(id="j", name="j", spec=JobSpec(job=JobSection(name="j")), world_size=1)
    j.state = JobState.RUNNING
    account(j, 1000.0)
    j.state = JobState.CHECKPOINTING
    account(j, 1021.0)  # persisting in the background while the ranks train on
    move_stall(j, 4.7)
    assert j.goodput["checkpoint_stall"] == pytest.approx(4.7)
    assert j.goodput["productive"] == pytest.approx(16.3)


def test_the_time_a_fault_went_unnoticed_is_recovery_not_productive() -> None:
    """Last step at 1000 s, the hang found and the job restarted at 1004 s (2 GPUs)."""
    j = JobRecord(id="j", name="j", spec=JobSpec(job=JobSection(name="j")), world_size=2)
    j.state = JobState.RUNNING
    account(j, 990.0)
    j.last_step_at = 1000.0
    charge_detection(j, 1004.0)
    assert j.goodput["productive"] == pytest.approx(20.0)
    assert j.goodput["recovery"] == pytest.approx(8.0)
    j.state, j.last_step_at = JobState.PAUSED, 1004.0  # paused time stays paused
    charge_detection(j, 1010.0)
    assert j.goodput["recovery"] == pytest.approx(8.0)


def test_steps_the_ranks_make_on_their_way_to_a_graceful_stop_are_training() -> None:
    """A preemption notice at 1000.5 s: the job recovers, and its ranks train on to the
    next boundary, where they checkpoint and stop. Their steps (1001 s, 1002.5 s, the
    second reported late) are training, not recovery; the wait after them is recovery."""
    j = job(JobState.RUNNING, step=40, step_s=0.5)
    account(j, 990.0)
    j.last_step_at = 1000.0
    charge_detection(j, 1000.5)  # the notice: the policy restarts, gracefully
    j.failed_at_step, j.state = j.step, JobState.RECOVERING
    stepped_while_stopping(j, 41, at=1001.0, now=1001.2)
    stepped_while_stopping(j, 42, at=1002.5, now=1003.5)
    account(j, 1005.0)
    assert j.goodput["productive"] == pytest.approx(4 * 12.5)  # 990 s to 1002.5 s
    assert j.goodput["recovery"] == pytest.approx(4 * 2.5)  # 1002.5 s to 1005 s
    assert j.failed_at_step == 42, "resumed from before them, they are redone"
    charge_lost_work(j, resumed_at_step=40)
    assert j.goodput["lost_work"] == pytest.approx(2 * 0.5 * 4)


def test_a_stopping_attempt_s_step_after_a_long_gap_trains_for_the_threshold_only() -> None:
    j = job(JobState.RUNNING, step=40, step_s=0.5)
    account(j, 990.0)
    j.last_step_at = 1000.0
    account(j, 1010.0)  # past the 3-s threshold: stalled
    charge_detection(j, 1010.0)
    j.state = JobState.RECOVERING
    stepped_while_stopping(j, 41, at=1010.0, now=1010.0)
    assert j.goodput["productive"] == pytest.approx(4 * 13.0)
    assert j.goodput["recovery"] == pytest.approx(4 * 7.0)
    stepped_while_stopping(j, 41, at=1009.0, now=1011.0)  # repeated, late: nothing more
    assert j.goodput["productive"] == pytest.approx(4 * 13.0)


def test_after_rank_0_says_training_ended_the_time_is_idle() -> None:
    j = JobRecord(id="j", name="j", spec=JobSpec(job=JobSection(name="j")), world_size=2)
    j.state = JobState.RUNNING
    account(j, 100.0)
    account(j, 110.0)
    j.finished = "completed"  # the ranks are exiting
    account(j, 111.5)
    assert j.goodput["productive"] == 20.0 and j.goodput["idle"] == 3.0


def test_lost_work_is_charged_at_the_ranks_own_step_time() -> None:
    j = JobRecord(id="j", name="j", spec=JobSpec(job=JobSection(name="j")), world_size=2)
    j.goodput = {"productive": 100.0, "lost_work": 0.0}
    observe_step_time(j, 9.0, first=True)  # an attempt's first step: start-up work
    assert j.step_s is None
    for seconds in (0.5, 0.5, 0.5):
        observe_step_time(j, seconds, first=False)
    j.failed_at_step = 40
    charge_lost_work(j, 30)  # 10 steps redone, 0.5 s each, 2 GPUs
    assert j.goodput["lost_work"] == pytest.approx(10.0)
    assert j.goodput["productive"] == pytest.approx(90.0)


def test_a_stalled_step_does_not_price_lost_work_but_a_slowdown_does() -> None:
    """A peer stopped mid-step: rank 0's last step took the hang's 3.1 s before the
    restart; the steps redone after it cost about what a step takes, not the stall's share.
    A lasting slowdown (steps four times as long) moves the estimate all the same."""
    j = JobRecord(id="j", name="j", spec=JobSpec(job=JobSection(name="j")), world_size=2)
    j.goodput = {"productive": 100.0, "lost_work": 0.0}
    for seconds in (0.02, 0.02, 3.1):
        observe_step_time(j, seconds, first=False)
    assert j.step_s == pytest.approx(0.022)
    j.failed_at_step = 140
    charge_lost_work(j, 100)  # 40 steps redone, 0.022 s each, 2 GPUs
    assert j.goodput["lost_work"] == pytest.approx(1.76)
    for _ in range(40):
        observe_step_time(j, 0.08, first=False)
    assert j.step_s == pytest.approx(0.08, rel=0.02)


def test_a_late_first_step_report_is_training_from_the_ranks_stamp() -> None:
    """Launched at 100 s; the first step finished at 110 s, its report arrived at 112.5 s."""
    j = job(JobState.STARTING, attempt_started_at=100.0)
    account(j, 100.0)
    account(j, 112.0)  # the ticks charged start-up meanwhile
    began_training(j, 110.0, 112.5)
    j.state = JobState.RUNNING
    account(j, 113.0)  # up to the stall threshold after that step
    assert j.goodput["startup"] == pytest.approx(10.0 * 4)
    assert j.goodput["productive"] == pytest.approx(3.0 * 4)


def test_a_stamp_never_reaches_back_past_the_attempt_or_the_lag_bound() -> None:
    assert stamp(0.0, 500.0) == 500.0  # no stamp: the arrival
    assert stamp(900.0, 500.0) == 500.0  # from the future: now
    assert stamp(1.0, 500.0) == 500.0 - MAX_LAG_S
    j = job(JobState.STARTING, restarts=1, attempt_started_at=108.0)
    j.goodput = dict.fromkeys(GOODPUT_BUCKETS, 0.0) | {"recovery": 100.0}  # earlier faults
    j.accounted_at = 108.0
    began_training(j, 100.0, 110.0)  # a stamp before this attempt launched
    assert j.goodput["recovery"] == pytest.approx(100.0 + 2.0 * 4 - 2.0 * 4)
    assert j.goodput["productive"] == pytest.approx(2.0 * 4)


def test_reports_late_past_the_stall_threshold_are_no_stall_when_the_stamps_say_so() -> None:
    """Steps every 0.1 s by the ranks' stamps; their reports held up 5 s (threshold 3 s)."""
    j = job(JobState.RUNNING)
    account(j, 100.0)
    stepped(j, 100.0, 100.0)
    account(j, 105.0)  # no report for 5 s: 2 s past the threshold charged as a stall
    assert j.goodput["recovery"] == pytest.approx(2.0 * 4)
    for k in range(1, 51):  # the held-up reports, all arriving at once
        stepped(j, 100.0 + 0.1 * k, 105.1)
    assert j.goodput["recovery"] == pytest.approx(0.0)
    assert j.goodput["productive"] == pytest.approx(5.1 * 4)


def test_a_real_gap_between_the_stamps_stays_a_stall() -> None:
    j = job(JobState.RUNNING)
    account(j, 100.0)
    stepped(j, 100.0, 100.0)
    account(j, 106.0)
    stepped(j, 105.0, 106.0)  # the ranks did not step for 5 s: 2 s past the threshold
    assert j.goodput["recovery"] == pytest.approx(2.0 * 4)
    assert j.goodput["productive"] == pytest.approx(4.0 * 4)


@pytest.mark.parametrize(
    ("silent_until", "at", "steps", "stall_s"),
    [
        # a leader change took the reports of a frozen bus's thaw and lost their word: the
        # next report comes 120 steps on, 12.1 s after the last one seen, and fills it all
        (112.5, 112.1, 120, 0.0),
        # 10 steps at 0.1 s in 9 s: 8.1 s had no step, 5.1 of it past the threshold
        (109.0, 109.0, 10, 5.1),
    ],
)
def test_what_the_steps_since_the_last_report_cannot_fill_stays_a_stall(
    silent_until: float, at: float, steps: int, stall_s: float
) -> None:
    j = job(JobState.RUNNING, step_s=0.1)
    account(j, 100.0)
    stepped(j, 100.0, 100.0)
    account(j, silent_until)
    assert j.goodput["recovery"] == pytest.approx((silent_until - 100.0 - 3.0) * 4)
    stepped(j, at, silent_until, steps=steps)
    assert j.goodput["recovery"] == pytest.approx(stall_s * 4)
    assert j.goodput["productive"] == pytest.approx((silent_until - 100.0 - stall_s) * 4)
