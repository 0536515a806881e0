"""The goodput ledger: every GPU-second of a job lands in exactly one bucket.

Wall time since the last accounting, times the job's world size, goes to the bucket of the
job's current state. Checkpoint stalls reported by rank 0 are moved from ``productive`` to
``checkpoint_stall`` as they arrive (see :meth:`JobManager.on_progress`). The
``checkpointing`` state (a checkpoint requested, not yet durable) is productive time: the
ranks train on while it persists in the background, and only the stall they report — the
time training was actually blocked — is a checkpoint's cost.

Time without a step is productive only up to the job's hang threshold (the same
``max(hang_step_factor × step time, hang_floor_s)`` the agents judge hangs by): past it,
whatever the cause and whether or not anything noticed, nothing trains, and it is
``recovery``.

Boundaries are the ranks' own stamps, not the arrival of their reports: a report can
reach the coordinator seconds late (a loaded node, a retried publish), and the ledger
must not charge that delivery as start-up or as a stall. A report's stamp moves a
boundary back at most ``MAX_LAG_S`` (a clock far off, or a forged stamp, skews one
boundary by that much at most) and never into the future.
"""

from __future__ import annotations

from coordinator import loop_support
from proto.job import GOODPUT_BUCKETS, JobRecord, JobState

MAX_LAG_S = 30.0  # the furthest back a rank's stamp moves a boundary

BUCKET_OF_STATE = {
    JobState.STARTING: "startup",
    JobState.RUNNING: "productive",
    JobState.PAUSED: "paused",
    JobState.CHECKPOINTING: "productive",
    JobState.RECOVERING: "recovery",
}


def account(job: JobRecord, now: float) -> None:
    if not job.goodput:
        job.goodput = dict.fromkeys(GOODPUT_BUCKETS, 0.0)
    last = job.accounted_at or now
    job.accounted_at = now
    bucket = BUCKET_OF_STATE.get(job.state)
    if job.state is JobState.STARTING and job.restarts:
        bucket = "recovery"  # a relaunch after a fault is recovery, not start-up
    elif bucket == "productive" and job.finished:
        bucket = "idle"  # rank 0 has said training ended: the ranks are only exiting
    elif bucket == "productive" and not loop_support.reports_steps(job):
        bucket = "unknown"  # no step is reported: training and redone work look alike
    gpus = job.world_size
    if bucket is None or gpus == 0 or now <= last:
        return
    if bucket == "productive" and job.phase is not None:
        _account_phase(job, last, now)
        return
    if bucket == "productive" and job.last_step_at is not None:
        stalled_from = max(last, job.last_step_at + stall_threshold(job))
        if stalled_from < now:
            job.goodput["recovery"] = job.goodput.get("recovery", 0.0) + (now - stalled_from) * gpus
            job.stalled_gpu_s += (now - stalled_from) * gpus
            now = stalled_from
    if now > last:
        job.goodput[bucket] = job.goodput.get(bucket, 0.0) + (now - last) * gpus


def _account_phase(job: JobRecord, last: float, now: float) -> None:
    """Time in a named phase (evaluation, data loading …) is the phase's, not
    productive, up to its bound (the stall threshold when it named none); past it, as
    past any stall threshold, nothing trains: recovery."""
    assert job.phase is not None
    bound = job.phase.bound_s if job.phase.bound_s is not None else stall_threshold(job)
    stalled_from = min(now, max(last, job.phase.since + bound))
    gpus = job.world_size
    name = job.phase.name
    job.phases[name] = job.phases.get(name, 0.0) + max(0.0, stalled_from - last) * gpus
    if stalled_from < now:
        job.goodput["recovery"] = job.goodput.get("recovery", 0.0) + (now - stalled_from) * gpus


def stamp(sent: float, now: float) -> float:
    """A rank's stamp as a boundary: within ``MAX_LAG_S`` before ``now``; none: ``now``."""
    return min(now, max(sent, now - MAX_LAG_S)) if sent > 0 else now


def _move(job: JobRecord, gpu_s: float, source: str, target: str) -> None:
    take = min(max(0.0, gpu_s), job.goodput.get(source, 0.0))
    job.goodput[source] = job.goodput.get(source, 0.0) - take
    job.goodput[target] = job.goodput.get(target, 0.0) + take


def began_training(job: JobRecord, at: float, now: float, source: str = "") -> None:
    """The first step of an attempt, finished at ``at`` and reported at ``now``: the job
    was charged to start-up (or recovery, after a fault) until now; from ``at`` on it
    trained. Call before the state moves to RUNNING. ``source``: the bucket the attempt
    was charged to instead (``unknown``: a script whose loop had said nothing yet), whose
    time before ``at`` is start-up (or recovery) and after it training."""
    account(job, now)
    at = max(at, job.attempt_started_at or at)  # never into an earlier attempt's time
    start = BUCKET_OF_STATE[JobState.STARTING] if not job.restarts else "recovery"
    if source:
        began = job.attempt_started_at or at
        _move(job, (at - began) * job.world_size, source, start)
        _move(job, (now - at) * job.world_size, source, "productive")
    else:
        _move(job, (now - at) * job.world_size, start, "productive")
    job.last_step_at, job.stalled_gpu_s = at, 0.0


def stepped(job: JobRecord, at: float, now: float, steps: int = 1) -> None:
    """A step finished at ``at``, reported at ``now``, ``steps`` after the previous report's
    (reports lost or dropped between two leaders leave more than one): of what was charged
    as a stall since that report, only what the interval holds beyond those steps at the
    job's step time, past the threshold, is one; the rest was training whose reports were
    late or never came."""
    account(job, now)
    if job.last_step_at is not None and job.stalled_gpu_s > 0:
        trained = max(0, steps - 1) * (job.step_s or 0.0)
        gap = max(0.0, at - job.last_step_at - trained - stall_threshold(job)) * job.world_size
        _move(job, job.stalled_gpu_s - gap, "recovery", "productive")
    job.last_step_at, job.stalled_gpu_s = max(at, job.last_step_at or at), 0.0


def stepped_while_stopping(
    job: JobRecord, step: int, at: float, now: float, world_size: int | None = None
) -> None:
    """A step of an attempt already given up, finished at ``at``: the ranks trained on to
    the boundary they stop at (a graceful restart: the step a preemption's checkpoint is
    made at; or the step in flight when the fault was found). Since the fault the ledger
    has charged recovery; from the previous step to this one, up to the stall threshold
    (as any gap between two steps), was training. ``failed_at_step`` follows the step:
    should the next attempt resume from before it, it is redone, and lost work.
    ``world_size``: the attempt's, when a relaunch has replaced it (a late step)."""
    account(job, now)
    if job.last_step_at is not None and at > job.last_step_at:
        trained = min(at - job.last_step_at, stall_threshold(job))
        gpus = job.world_size if world_size is None else world_size
        _move(job, trained * gpus, "recovery", "productive")
        job.last_step_at = at
    job.failed_at_step = max(job.failed_at_step, step)


def stall_threshold(job: JobRecord) -> float:
    """Seconds without a step after which the ranks count as stalled, not training."""
    pol = job.spec.policy
    return max(pol.hang_step_factor * (job.step_s or 0.0), pol.hang_floor_s)


def move_stall(job: JobRecord, seconds: float) -> None:
    """A checkpoint stall already counted as productive time moves to its own bucket."""
    # a negative stall is rank 0's garbage
    _move(job, seconds * job.world_size, "productive", "checkpoint_stall")


def charge_lost_work(job: JobRecord, resumed_at_step: int) -> None:
    """After a restart, steps between the checkpoint resumed from and the step reached
    before the fault are computed twice: their time moves from productive to lost_work,
    at the job's recent wall time per step (``job.step_s``: between consecutive steps'
    reports), else at its average productive step time so far."""
    redo = job.failed_at_step - resumed_at_step
    done = max(job.failed_at_step, 1)
    if redo <= 0 or job.world_size == 0:
        return
    per_step = job.goodput.get("productive", 0.0) / done
    if job.step_s is not None:
        per_step = job.step_s * job.world_size
    take = min(redo * per_step, job.goodput.get("productive", 0.0))
    job.goodput["productive"] -= take
    job.goodput["lost_work"] = job.goodput.get("lost_work", 0.0) + take


def charge_detection(job: JobRecord, now: float) -> None:
    """A restart: the time since the ranks' last step (``job.last_step_at``) was counted
    as productive while the fault went unnoticed (a hang found seconds later, a dead peer
    found by its exit), but nothing trained in it: it is recovery."""
    if job.last_step_at is None or job.state not in (JobState.RUNNING, JobState.CHECKPOINTING):
        return
    account(job, now)
    # only the part of the gap below the stall threshold was counted productive
    gpu_s = max(0.0, min(now - job.last_step_at, stall_threshold(job))) * job.world_size
    _move(job, gpu_s, "productive", "recovery")
    job.stalled_gpu_s = 0.0  # what the stall rule charged stays recovery


def observe_step_time(job: JobRecord, seconds: float, first: bool) -> None:
    """One step's wall time into the job's running estimate (an exponential average); an
    attempt's first step (start-up work, compilation) is left out, as is a zero (no
    consecutive step to measure from). A step counts at most twice the estimate: the last
    step before a fault is often the one the ranks stalled in (a peer stopped, until the
    hang was found), and at full weight it would price every redone step at the stall's
    share; a lasting slowdown still moves the estimate, by up to a tenth a step."""
    if first or not seconds > 0:
        return
    if job.step_s is not None:
        seconds = min(seconds, 2.0 * job.step_s)
    job.step_s = seconds if job.step_s is None else 0.9 * job.step_s + 0.1 * seconds
