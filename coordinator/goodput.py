"""The goodput ledger: every GPU-second of a job lands in exactly one bucket.

Wall time since the last accounting, times the job's world size, goes to the bucket of the
job's current state. Checkpoint stalls reported by rank 0 are moved from ``productive`` to
``checkpoint_stall`` as they arrive (see :meth:`JobManager.on_progress`).
"""

from __future__ import annotations

from proto.job import GOODPUT_BUCKETS, JobRecord, JobState

BUCKET_OF_STATE = {
    JobState.STARTING: "startup",
    JobState.RUNNING: "productive",
    JobState.PAUSED: "paused",
    JobState.CHECKPOINTING: "checkpoint_stall",
    JobState.RECOVERING: "recovery",
}


def account(job: JobRecord, now: float) -> None:
    if not job.goodput:
        job.goodput = dict.fromkeys(GOODPUT_BUCKETS, 0.0)
    last = job.accounted_at or now
    job.accounted_at = now
    bucket = BUCKET_OF_STATE.get(job.state)
    gpus = job.world_size
    if bucket is None or gpus == 0 or now <= last:
        return
    job.goodput[bucket] = job.goodput.get(bucket, 0.0) + (now - last) * gpus


def move_stall(job: JobRecord, seconds: float) -> None:
    """A checkpoint stall already counted as productive time moves to its own bucket."""
    gpu_s = seconds * job.world_size
    take = min(gpu_s, job.goodput.get("productive", 0.0))
    job.goodput["productive"] = job.goodput.get("productive", 0.0) - take
    job.goodput["checkpoint_stall"] = job.goodput.get("checkpoint_stall", 0.0) + take
