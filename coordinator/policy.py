"""Fault policy: a pure function from (job, event) to actions. No I/O; the service applies
the actions. Defaults and thresholds come from the job's ``[policy]`` section.

Pauses are reference-counted by reason: a job is paused while any reason is open (an NVMe
device in a latency spike, an operator's pause) and resumes when the last one closes, so
two overlapping faults never resume the job early.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.events import (
    ClockDrift,
    ClockResynced,
    EventBase,
    GpuThermal,
    NodeLost,
    NvmeLatencyRecovered,
    NvmeLatencySpike,
    NvmeReadonly,
    SpotNotice,
    WorkerExited,
)
from proto.job import JobRecord, JobState

LIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.PAUSED, JobState.CHECKPOINTING})


@dataclass(frozen=True)
class PauseJob:
    key: str
    reason: str


@dataclass(frozen=True)
class ResumeJob:
    key: str
    reason: str


@dataclass(frozen=True)
class CheckpointJob:
    reason: str


@dataclass(frozen=True)
class RestartJob:
    reason: str
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True)
class DrainNode:
    node: str
    reason: str


@dataclass(frozen=True)
class ResyncNode:
    node: str
    reason: str


@dataclass(frozen=True)
class FinishJob:
    state: JobState
    reason: str


Action = PauseJob | ResumeJob | CheckpointJob | RestartJob | DrainNode | ResyncNode | FinishJob


def decide(job: JobRecord, event: EventBase) -> list[Action]:
    if job.state not in LIVE or (event.node is not None and event.node not in job.nodes):
        return []
    pol = job.spec.policy
    match event:
        case NvmeLatencySpike(node=node, device=dev, latency_us=lat) if lat >= pol.nvme_pause_us:
            return [PauseJob(f"nvme:{node}:{dev}", f"NVMe {dev} on {node} at {lat:.0f} µs")]
        case NvmeLatencyRecovered(node=node, device=dev, latency_us=lat):
            return [ResumeJob(f"nvme:{node}:{dev}", f"NVMe {dev} on {node} back to {lat:.0f} µs")]
        case WorkerExited(attempt=attempt) if attempt != job.attempt or job.stopping:
            return all_exited(job) if job.stopping and attempt == job.attempt else []
        case WorkerExited() if job.finished:
            # Rank 0 already reported the end (its final checkpoint is durable): a rank
            # dying during teardown loses nothing, so it is no reason to restart.
            return all_exited(job)
        case WorkerExited(node=node, rank=rank, exit_code=code) if code != 0:
            return _restart_or_fail(job, f"rank {rank} on {node} failed ({event.message})", ())
        case WorkerExited():
            return all_exited(job)
        case NodeLost(node=str(node)):
            return [
                DrainNode(node, "heartbeat lost"),
                *_restart_or_fail(job, f"node {node} lost", (node,)),
            ]
        case NvmeReadonly(node=str(node), device=dev, readonly=True):
            why = f"NVMe {dev} on {node} turned read-only"
            return [CheckpointJob(why), DrainNode(node, why), *_restart_or_fail(job, why, (node,))]
        case SpotNotice(node=str(node), provider=provider):
            why = f"preemption notice on {node} ({provider})"
            return [CheckpointJob(why), DrainNode(node, why), *_restart_or_fail(job, why, (node,))]
        case GpuThermal(node=str(node), temp_c=temp, gpu=gpu, level=level) if (
            level != "normal" and (level == "critical" or temp >= pol.gpu_critical_c)
        ):
            # critical: at the threshold, or a hardware thermal slowdown below it
            why = f"GPU {gpu} on {node} at {temp:.0f} °C ({', '.join(event.reasons) or level})"
            return [CheckpointJob(why), DrainNode(node, why), *_restart_or_fail(job, why, (node,))]
        case ClockResynced(node=str(node), ok=False, offset_after_ms=after):
            why = f"clock on {node} still {after:.1f} ms off after a resync"
            return [DrainNode(node, why), *_restart_or_fail(job, why, (node,))]
    return []


def decide_node(event: EventBase) -> list[Action]:
    """Reactions that concern a node whether or not it hosts a job."""
    match event:
        case ClockDrift(node=str(node), recovered=False, offset_ms=offset, synced=synced):
            state = f"{offset:.1f} ms off" if synced else "unsynchronised"
            return [ResyncNode(node, f"clock {state}")]
    return []


def _restart_or_fail(job: JobRecord, reason: str, exclude: tuple[str, ...]) -> list[Action]:
    if job.restarts >= job.spec.policy.max_restarts:
        return [FinishJob(JobState.FAILED, f"{reason}; restart budget of {job.restarts} spent")]
    return [RestartJob(reason, exclude)]


def all_exited(job: JobRecord) -> list[Action]:
    """Every rank of the current attempt has exited (cleanly, or on our stop). Rank 0's
    last progress may still be in flight (it travels on another stream), so an unexplained
    early exit is left to :func:`overdue`."""
    if len(job.exited_ranks) < job.world_size:
        return []
    if job.stopping or job.finished == "stopped":
        return [FinishJob(JobState.STOPPED, job.reason or "stopped")]
    if job.finished == "completed" or job.step >= job.target_steps:
        return [FinishJob(JobState.COMPLETED, f"reached step {job.step}")]
    if job.spec.job.entry and all(code == 0 for code in job.exited_ranks.values()):
        # A user's own script reports no steps: a clean exit of every rank is success.
        return [FinishJob(JobState.COMPLETED, "every rank of the entry point exited 0")]
    return []


def overdue(job: JobRecord) -> list[Action]:
    """All ranks exited cleanly but rank 0 never reported the end: fail the job."""
    if job.state in LIVE and len(job.exited_ranks) >= job.world_size > 0:
        return [
            FinishJob(JobState.FAILED, f"ranks exited at step {job.step} of {job.target_steps}")
        ]
    return []


def open_reason(reasons: list[str], key: str) -> tuple[list[str], bool]:
    """Add a pause reason; True when it is the first (the job must be paused now)."""
    if key in reasons:
        return reasons, False
    return [*reasons, key], not reasons


def close_reason(reasons: list[str], key: str) -> tuple[list[str], bool]:
    """Remove a pause reason; True when it was the last (the job may resume now)."""
    if key not in reasons:
        return reasons, False
    remaining = [r for r in reasons if r != key]
    return remaining, not remaining
