"""What a job's training loop can carry out, and, where it cannot, why in one line: the
one owner of that answer for the policy, the operator's commands, ``status`` and ``start``.

The loop says what it supports when rank 0 opens the rank API (``LoopReady``, kept as
``JobRecord.loop``). Before it has said anything, the built-in trainer is known by its job
file (it opens the API on every start; the memory tier is its ``checkpoint.memory_tier``),
and a user's ``entry`` script is taken to support nothing: a script that never opens the
API can only be started, killed and restarted, and saying otherwise would report effects
nobody carries out.
"""

from __future__ import annotations

from proto.job import JobRecord
from proto.progress import Reaction

ALL = tuple(Reaction)
INTEGRATE = "open ringmaster.rank in the script, or use an integration (docs/integrations.md)"


def reactions(job: JobRecord) -> tuple[Reaction, ...]:
    """The reactions the job's loop carries out, in the contract's order."""
    if job.loop is not None:
        said = set(job.loop.reactions)
        return tuple(r for r in ALL if r in said)
    if job.spec.job.entry:
        return ()
    tier = job.spec.checkpoint.memory_tier
    return tuple(r for r in ALL if r is not Reaction.MEMORY_TIER or tier)


def reports_steps(job: JobRecord) -> bool:
    """Whether the job's loop reports its steps (the built-in trainer, any loop that
    opened the rank API): only then can the ledger tell training from redone work."""
    return job.loop is not None or not job.spec.job.entry


def lacking(job: JobRecord, reaction: Reaction) -> str | None:
    """Why the job cannot carry out ``reaction``, in words for the operator; None if it can."""
    if reaction in reactions(job):
        return None
    if job.loop is None:
        return f"its script has not opened the rank API ({INTEGRATE})"
    return f"its loop ({job.loop.framework}) does not support it"


def summary(job: JobRecord) -> str:
    """``pause, checkpoint, memory tier, hang by beat`` (and what it lacks), for people."""
    has = reactions(job)
    lacks = [r.value for r in ALL if r not in has]
    said = ", ".join(r.value for r in has) or "none"
    if lacks:
        said += f" (not: {', '.join(lacks)})"
    if job.loop is None and job.spec.job.entry:
        said += f"; {INTEGRATE} for them"
    return said
