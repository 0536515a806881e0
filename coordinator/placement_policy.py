"""Where and how long a job waits to be placed: the fewest nodes its next attempt may
run on, and when waiting for nodes ends (failed, or inside a scheduler's allocation,
stopped to be requeued). Pure: the job and ``now`` in; callers pass the time."""

from __future__ import annotations

from coordinator.actions import Action, FinishJob
from proto.job import JobRecord, JobState


def minimum_nodes(job: JobRecord) -> int:
    """The fewest nodes the job's next attempt may run on: ``[job] min_nodes`` once it has
    run (a first start waits for all its nodes), unless its checkpoints cannot load at
    another world size (DeepSpeed ZeRO-0's; ZeRO-1 to 3 reshard through DeepSpeed's
    universal checkpoint)."""
    spec = job.spec
    if not job.attempt or spec.job.min_nodes is None:
        return spec.job.nodes
    if not spec.job.entry and spec.train.engine == "deepspeed" and spec.train.zero_stage == 0:
        return spec.job.nodes
    return spec.job.min_nodes


def waited_too_long(job: JobRecord, now: float) -> list[Action]:
    """A job that cannot run (too few healthy nodes) fails after ``wait_for_nodes_s``
    with the reason it waited for, instead of waiting forever. Inside a scheduler's
    allocation no other node can come, and an allocation held idle is wasted: a job that
    cannot be placed there stops after :func:`allocation_wait` to be requeued (Slurm gives
    the next run other nodes: those Ringmaster will not use are drained there too)."""
    limit = job.spec.policy.wait_for_nodes_s
    inside = allocation_wait(job)
    if inside is not None:
        limit = min(limit, inside)
    if job.waiting_since is None or now - job.waiting_since < limit:
        return []
    why = job.reason or "not enough healthy nodes"
    if job.allocation is not None and inside is not None:
        go_on = "continue" if job.state is JobState.RECOVERING else "start"
        said = f"cannot {go_on} inside Slurm job {job.allocation.job_id}'s allocation"
        return [FinishJob(JobState.STOPPED, f"{said}: {why}; requeue it", requeue=True)]
    return [FinishJob(JobState.FAILED, f"gave up after {limit:g} s {why}")]


def allocation_wait(job: JobRecord) -> float | None:
    """How long a job inside a scheduler's allocation waits to be placed there (None:
    outside one, or not waiting to be placed): a restart :data:`ALLOCATION_WAIT_S`, a
    first start :data:`ALLOCATION_START_WAIT_S`."""
    if job.allocation is None:
        return None
    if job.state is JobState.RECOVERING:
        return ALLOCATION_WAIT_S
    return ALLOCATION_START_WAIT_S if job.state is JobState.PENDING else None


# s: how long a restart inside a scheduler's allocation waits for its nodes (an agent's
# restart fits in it)
ALLOCATION_WAIT_S = 15.0
# s: how long a first start inside one waits (agents starting with the allocation fit in it)
ALLOCATION_START_WAIT_S = 60.0
