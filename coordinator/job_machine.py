"""The job state machine: the one place a job's state changes, and the budgets with it.

Every change is a row of :data:`TABLE`, (state, input) → next state and the effects the I/O
shell (:mod:`coordinator.jobs`) carries out; an input with no row for the job's state
changes nothing (a late, repeated or foreign message costs nothing). ``docs/architecture.md``
lists the same rows, and a test checks that it does.

The restart budget counts a *repeated* cause (a crash loop), not faults: a failure whose
signature (:class:`proto.job.Failure`) matches the last one's — the same node, or the same
rank failing the same way near the same step — without the job having trained past it
spends one; a failure on a node that is then left out, or with another cause, starts the
count again. Pure: no I/O, no clock but the ``now`` callers pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from proto.job import Failure, JobRecord, JobState
from proto.recurrence import same_place_steps

P, S, R, PA, C, RE = (
    JobState.PENDING,
    JobState.STARTING,
    JobState.RUNNING,
    JobState.PAUSED,
    JobState.CHECKPOINTING,
    JobState.RECOVERING,
)
DONE, FAILED, STOPPED = JobState.COMPLETED, JobState.FAILED, JobState.STOPPED
LIVE = frozenset({S, R, PA, C})  # an attempt's ranks run (or are launching)


class Input(enum.StrEnum):
    LAUNCH = "launch"  # an attempt was admitted and its record saved: ranks are launching
    UNDO_FIRST_LAUNCH = "undo_first_launch"  # a first start's launch failed on a node
    UNDO_RELAUNCH = "undo_relaunch"  # a restart's launch failed on a node
    TRAINING = "training"  # the attempt's first step (a user's script: its launch)
    PAUSED = "paused"  # rank 0 paused at a step boundary
    RESUMED = "resumed"
    CHECKPOINT = "checkpoint"  # rank 0 accepted a checkpoint request
    CHECKPOINTED = "checkpointed"  # rank 0 made it durable
    FAULT = "fault"  # the attempt is given up: stop it, then launch another
    ATTEMPT_STOPPED = "attempt_stopped"  # the stop of the given-up attempt finished
    STOP = "stop"  # the operator asked for a stop: the ranks are being stopped
    STOPPED = "stopped"  # the stop is done (or its grace ran out)
    COMPLETE = "complete"  # rank 0 said it reached its target and every rank exited 0
    FAIL = "fail"


class Effect(enum.StrEnum):
    STOP_ATTEMPT = "stop_attempt"  # stop the current attempt's ranks (a task)
    STOP_JOB = "stop_job"  # the operator's stop of every rank (a task)
    KILL_RANKS = "kill_ranks"  # kill whatever of the job still runs
    ANNOUNCE_END = "announce_end"  # publish job.completed | failed | stopped


@dataclass(frozen=True)
class Row:
    next: JobState
    effects: tuple[Effect, ...] = ()


_LIVE = (S, R, PA, C)
_END = (Effect.KILL_RANKS, Effect.ANNOUNCE_END)

TABLE: dict[tuple[JobState, Input], Row] = {
    (P, Input.LAUNCH): Row(S),
    (RE, Input.LAUNCH): Row(S),
    (S, Input.UNDO_FIRST_LAUNCH): Row(P),
    (S, Input.UNDO_RELAUNCH): Row(RE),
    (S, Input.TRAINING): Row(R),
    (S, Input.PAUSED): Row(PA),  # a relaunch held by a pause reason still open
    (R, Input.PAUSED): Row(PA),
    (C, Input.PAUSED): Row(PA),
    (PA, Input.RESUMED): Row(R),
    (R, Input.CHECKPOINT): Row(C),
    (C, Input.CHECKPOINTED): Row(R),
    **{(s, Input.FAULT): Row(RE, (Effect.STOP_ATTEMPT,)) for s in _LIVE},
    (RE, Input.ATTEMPT_STOPPED): Row(RE),
    **{(s, Input.STOP): Row(s, (Effect.STOP_JOB,)) for s in _LIVE},
    (P, Input.STOP): Row(STOPPED, (Effect.ANNOUNCE_END,)),
    (RE, Input.STOP): Row(STOPPED, _END),
    **{(s, Input.STOPPED): Row(STOPPED, _END) for s in (*_LIVE, P, RE)},
    **{(s, Input.COMPLETE): Row(DONE, (Effect.ANNOUNCE_END,)) for s in (S, R, C)},
    **{(s, Input.FAIL): Row(FAILED, _END) for s in (*_LIVE, P, RE)},
}


def fire(job: JobRecord, what: Input) -> Row | None:
    """Move ``job`` by ``what``: the row taken, or None (no row: nothing changes)."""
    row = TABLE.get((job.state, what))
    if row is None:
        return None
    job.state = row.next
    if what is Input.FAULT:
        job.stopping_attempt = job.attempt
    elif what is Input.ATTEMPT_STOPPED:
        job.stopping_attempt = 0
    elif what is Input.STOP:
        job.stopping = True
    return row


# -- budgets ----------------------------------------------------------------------------


def near(job: JobRecord) -> int:
    """How many steps apart two failures of one rank still count as "the same place"."""
    return same_place_steps(job.spec.checkpoint.every_steps)


def same_cause(job: JobRecord, a: Failure, b: Failure) -> bool:
    return a.node == b.node or (
        a.rank is not None
        and a.rank == b.rank
        and a.cause == b.cause
        and abs(a.step - b.step) <= near(job)
    )


def charge(job: JobRecord, failure: Failure, left_out: tuple[str, ...]) -> str | None:
    """Count ``failure`` against the restart budget; the reason the job fails (naming the
    repeated signature) when the budget is spent, else None (restart). A failure on a node
    the restart leaves out spends nothing: that node cannot fail the next attempt."""
    limit = job.spec.policy.max_restarts
    last = job.last_failure
    if limit == 0:
        return "max_restarts = 0: no restarts allowed"
    if failure.node in left_out:
        job.restarts_in_row = 0
    elif last is not None and job.restarts_in_row and same_cause(job, failure, last):
        job.restarts_in_row += 1
    else:
        job.restarts_in_row = 1
    job.last_failure = failure
    job.failing_at_step = max(job.step, failure.step)
    if job.restarts_in_row > limit:
        return (
            f"restart budget of {limit} spent: {job.restarts_in_row} failures in a row of "
            f"{describe(failure)} without training past step {job.failing_at_step}"
        )
    return None


def trained_to(job: JobRecord, step: int) -> None:
    """A step reported by the current attempt: past the failures' step, the loop is over."""
    if step > job.failing_at_step and job.restarts_in_row:
        job.restarts_in_row, job.last_failure = 0, None


def describe(failure: Failure) -> str:
    who = f"rank {failure.rank} on {failure.node}" if failure.rank is not None else failure.node
    return f"{who}: {failure.cause} near step {failure.step}"
