"""The operator's requests, as the job manager takes them in: a job submitted, and a
pause, resume, checkpoint or stop of one. A submission makes the job's record and its
announcement, for the manager to keep and say; a request acts through the manager's
:class:`coordinator.job_effects.JobEffects` and is answered once the record is saved. An
operator's pause is a condition on the job, decided by the policy like a fault's."""

from __future__ import annotations

import secrets
from pathlib import Path

from coordinator import loop_support, policy
from coordinator.job_effects import JobEffects
from proto.api import ApiReply, JobControl, SubmitJob
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import JobSubmitted
from proto.job import Allocation, JobRecord
from proto.progress import Reaction


def submitted(req: SubmitJob, now: float) -> tuple[JobRecord, JobSubmitted]:
    """The new job's record, and what announces it."""
    spec = req.spec
    job_id = f"{spec.job.name}-{secrets.token_hex(3)}"
    ckpt = Path(spec.checkpoint.dir)
    if not ckpt.is_absolute():
        spec.checkpoint.dir = str(Path(req.workdir or ".") / ckpt)
    if req.allocation is not None:
        # the allocated nodes beyond the job's are its spares
        spec.job.spares = max(spec.job.spares, len(req.allocation.hosts) - spec.job.nodes)
    job = JobRecord(
        id=job_id,
        name=spec.job.name,
        spec=spec,
        allocation=req.allocation,
        workdir=req.workdir,
        target_steps=spec.train.steps,
        resume_step=req.resume_step,
        resume_job=req.resume_job,
        submitted_at=now,
    )
    said = JobSubmitted(
        job=job_id,
        name=spec.job.name,
        nodes=spec.job.nodes,
        gpus_per_node=spec.job.gpus_per_node,
        message=f"submitted from {req.source or 'api'}" + _inside(req.allocation),
    )
    return job, said


async def control(
    job: JobRecord | None, req: JobControl, effects: JobEffects, now: float
) -> ApiReply:
    """The operator's request about ``job`` (None: no such job), carried out and
    answered."""
    if job is None:
        return ApiReply(ok=False, error=f"no job {req.job!r}")
    if job.state.terminal:
        return ApiReply(ok=False, error=f"job {job.id} is already {job.state.value}")
    if req.action in ("pause", "checkpoint"):
        why = loop_support.lacking(job, Reaction(req.action))
        if why is not None:
            return ApiReply(ok=False, job=job.id, error=f"job {job.id} cannot {req.action}: {why}")
    match req.action:
        case "pause" | "resume":
            # The operator's pause is a condition on the job, through the same path as a
            # fault's: resuming closes only the operator's own reason.
            opened = req.action == "pause"
            cond = Condition(
                kind=ConditionKind.OPERATOR,
                job=job.id,
                active=opened,
                severity=Severity.INFO,
                reason=f"operator {'pause' if opened else 'resume'}",
                since=now,
            )
            for action in policy.on_condition(job, cond):
                await effects.apply(job, action)
        case "checkpoint":
            await effects.checkpoint(job, "operator request")
        case "stop":
            job.requeue = req.requeue
            await effects.stop(job, req.reason or "stop requested by operator")
    if not job.state.terminal:
        await effects.table.save(job)
    if req.action == "resume" and job.pause_reasons:
        held = ", ".join(job.pause_reasons)
        return ApiReply(ok=False, job=job.id, error=f"job {job.id} stays paused: {held}")
    if req.action == "stop" and (why := loop_support.lacking(job, Reaction.PAUSE)):
        note = f"its ranks are terminated, with no checkpoint at a step first: {why}"
        return ApiReply(ok=True, job=job.id, note=note)
    return ApiReply(ok=True, job=job.id)


def _inside(allocation: Allocation | None) -> str:
    return "" if allocation is None else f" in {allocation}"
