"""Requests from ``coordinatorctl`` to the leading coordinator, and its replies."""

from __future__ import annotations

from typing import Literal

import msgspec

from proto.job import Allocation, JobSpec


class SubmitJob(msgspec.Struct, kw_only=True):
    spec: JobSpec
    workdir: str = ""
    source: str = ""
    # where the submitter found training would resume: the newest sealed checkpoint's step
    # and the job that wrote it (None: no checkpoint, a fresh start)
    resume_step: int | None = None
    resume_job: str = ""
    allocation: Allocation | None = None  # started inside a scheduler's allocation


class JobControl(msgspec.Struct, kw_only=True):
    job: str
    action: Literal["pause", "resume", "checkpoint", "stop"]
    reason: str = ""  # why, in the job's events ("" : the operator asked)
    # a stop because the job's allocation ends (the scheduler's signal): it is to be
    # requeued once stopped at its checkpoint
    requeue: bool = False


class NodeControl(msgspec.Struct, kw_only=True):
    """``coordinatorctl cordon|drain|undrain NODE`` → the leader (``subjects.api(…,
    "node")``). ``by``: who asks, as the CLI knows them (its NATS user, else the login
    name); the leader records it with the drain."""

    node: str
    action: Literal["cordon", "drain", "undrain"]
    reason: str = ""  # why (a drain needs one)
    by: str = ""


class ApiReply(msgspec.Struct, kw_only=True):
    ok: bool
    error: str = ""
    job: str = ""
    coordinator: str = ""
    note: str = ""  # how an accepted request is carried out, when it matters


class InjectFault(msgspec.Struct, kw_only=True):
    """``coordinatorctl inject NODE FAULT`` → the simulator of NODE (``subjects.sim``)."""

    fault: str


class InjectReply(msgspec.Struct, kw_only=True):
    ok: bool
    error: str = ""
    faults: list[str] = msgspec.field(default_factory=list)
