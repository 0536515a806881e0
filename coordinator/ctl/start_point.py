"""Where a job ``coordinatorctl start`` submits begins training: fresh, or from a checkpoint.

The trainer resumes from whatever sealed checkpoint its ``checkpoint.dir`` holds, whichever
job wrote it. That is what restarts need, but a new job pointed at an old job's dir would
quietly continue it, and if that job had already trained past this one's target, "complete"
seconds later without training at all. So before submitting, ``start`` reads the dir the
ranks will read (resolved as the coordinator resolves it: relative to the directory
``start`` runs in), says on stderr where training will begin and which job wrote that
checkpoint, and refuses a checkpoint at or past the target unless the operator chooses:
``--resume`` (continue it anyway) or ``--fresh`` (a new dir beside it; the old one is left
untouched). This needs no bus, so a refused start touches nothing. Once connected,
``start`` also refuses a dir that a job still running writes to.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from coordinator.ctl.errors import CtlError
from proto.job import JobRecord, JobSpec
from ringmaster.checkpoints import Sealed, newest_sealed


@dataclass(frozen=True)
class StartPoint:
    """What ``start`` decided: the checkpoint dir to submit, where training resumes
    (``resume_step`` None: from scratch) and the stderr line saying so."""

    checkpoint_dir: str
    resume_step: int | None
    resume_job: str
    note: str


def checkpoint_root(spec: JobSpec, workdir: Path) -> Path:
    """The dir the ranks will use, resolved as ``JobManager.submit`` resolves it."""
    ckpt = Path(spec.checkpoint.dir)
    return ckpt if ckpt.is_absolute() else workdir / ckpt


def decide(
    spec: JobSpec,
    workdir: Path,
    *,
    resume: bool = False,
    fresh: bool = False,
    now: datetime | None = None,
) -> StartPoint:
    """Read the newest sealed checkpoint in the job's dir and decide; raises
    :class:`CtlError` (exit 2) for a finished checkpoint without ``--resume``/``--fresh``."""
    if resume and fresh:
        raise CtlError("--resume and --fresh cannot be used together", code=2)
    root = checkpoint_root(spec, workdir)
    target = spec.train.steps
    try:
        found = newest_sealed(root)
    except ValueError:  # a NUL byte in the name
        raise CtlError(
            f"checkpoint.dir = {spec.checkpoint.dir!r}: not a usable path", code=2
        ) from None
    if found is None:
        return StartPoint(str(root), None, "", f"starting fresh (no checkpoint in {root})")
    if fresh:
        beside = sibling(root, now or datetime.now(UTC))
        return StartPoint(
            str(beside),
            None,
            "",
            f"starting fresh in {beside} (--fresh; the checkpoints in {root}, newest "
            f"step {found.step} written by {_writer(found)}, are left as they are)",
        )
    where = f"written by {_writer(found)}, {found.path}"
    if found.step < target:
        note = f"resuming from step {found.step} of {target} ({where})"
    elif resume:
        note = (
            f"resuming from step {found.step} ({where}), at or past the target of {target} "
            "steps (--resume): the job will end without training"
        )
    else:
        raise CtlError(
            f"{root} holds a checkpoint at step {found.step} written by {_writer(found)}, "
            f"at or past this job's target of {target} steps, so it would end without "
            "training; pass --resume to resume from it anyway, or --fresh to start over "
            "in a new directory beside it",
            code=2,
        )
    return StartPoint(str(root), found.step, found.job, note)


def sharing(jobs: Iterable[JobRecord], checkpoint_dir: str) -> JobRecord | None:
    """A job not yet ended that uses ``checkpoint_dir`` too. Two jobs writing one dir
    overwrite each other's ``latest`` and prune each other's steps, and what this check
    found would not be what the new job resumes from once it launches."""
    mine = os.path.normpath(checkpoint_dir)
    return next(
        (
            job
            for job in jobs
            if not job.state.terminal and os.path.normpath(job.spec.checkpoint.dir) == mine
        ),
        None,
    )


def in_use(job: JobRecord) -> CtlError:
    return CtlError(
        f"{job.spec.checkpoint.dir} is the checkpoint dir of job {job.id}, still "
        f"{job.state.value}: two jobs writing one dir overwrite each other's checkpoints; "
        "wait for it to end or stop it, or pass --fresh to start in a new directory beside it",
        code=2,
    )


def sibling(root: Path, now: datetime) -> Path:
    """``<dir>-<UTC time>`` next to ``root`` (``-2``, ``-3`` ... if that exists already)."""
    base = Path(os.path.normpath(root))
    if not base.name:
        raise CtlError(f"--fresh: {root} has no parent to start a new directory beside", code=2)
    stem = f"{base.name}-{now.astimezone(UTC):%Y%m%dT%H%M%SZ}"
    candidate, n = base.with_name(stem), 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{stem}-{n}")
    return candidate


def _writer(found: Sealed) -> str:
    return f"job {found.job}" if found.job else "a job that did not record its id"
