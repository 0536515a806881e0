"""What the fault policy decides and the job manager carries out: one frozen dataclass per
kind of action, their union :data:`Action`. Pure data; :mod:`coordinator.policy`,
:mod:`coordinator.progress_policy` and :mod:`coordinator.numeric_policy` make them,
:mod:`coordinator.job_effects` applies them."""

from __future__ import annotations

from dataclasses import dataclass

from proto.job import Failure, JobState


@dataclass(frozen=True)
class PauseJob:
    """Hold the job under ``key``; ``reasons`` is the job's open reasons after it and
    ``send`` says whether rank 0 must be told (the first reason)."""

    key: str
    reason: str
    reasons: tuple[str, ...]
    send: bool


@dataclass(frozen=True)
class ResumeJob:
    """Release ``key``; ``send`` when it was the last reason holding the job."""

    key: str
    reason: str
    reasons: tuple[str, ...]
    send: bool


@dataclass(frozen=True)
class CheckpointJob:
    reason: str


@dataclass(frozen=True)
class RestartJob:
    """Restart without ``exclude``; ``failure``: what failed, for the restart budget
    (:func:`coordinator.job_machine.charge`; None: nothing failed, as after a preflight
    refusal, a replacement or growing back); ``graceful``: the ranks stop at the next step
    boundary with a checkpoint first, so the next attempt resumes from exactly that step
    (an evacuation with notice, a replacement, growing back) instead of being killed."""

    reason: str
    exclude: tuple[str, ...] = ()
    failure: Failure | None = None
    graceful: bool = False


@dataclass(frozen=True)
class ReportStraggler:
    """Publish ``worker.straggler`` for ``rank`` on ``node``."""

    node: str
    rank: int
    step_s: float
    peer_median_s: float


@dataclass(frozen=True)
class RefuseNode:
    """Publish ``node.refused``: the job will not run on ``node`` (paired with a restart
    that excludes it)."""

    node: str
    reason: str


@dataclass(frozen=True)
class DeclareLost:
    """An away node whose job's ranks stopped stepping is gone: ``node.lost``, once (the
    leader's next sweep publishes it)."""

    node: str
    reason: str


@dataclass(frozen=True)
class DrainNode:
    """Drain ``node`` for its open condition ``key``, ``reason`` the evidence, while that
    condition stays open: a judgement its severity alone does not make (a clock a resync
    could not bring back). Critical conditions and lost nodes drain by themselves
    (:mod:`coordinator.node_life`)."""

    node: str
    key: str
    reason: str


@dataclass(frozen=True)
class HoldNode:
    """Hold ``node`` for a person: its ranks alone computed non-finite values again and
    again (``evidence``: the faults), which no health gate can see
    (:func:`coordinator.node_verbs.hold`)."""

    node: str
    evidence: str


@dataclass(frozen=True)
class ResyncNode:
    node: str
    reason: str


@dataclass(frozen=True)
class Unheeded:
    """A condition the job's loop cannot react to (a pause it cannot take): ``opened``,
    record ``key`` and publish ``job.unheeded`` naming ``reaction`` and ``why``, once;
    closed, forget it."""

    key: str
    reaction: str
    reason: str
    why: str
    opened: bool = True


@dataclass(frozen=True)
class FinishJob:
    state: JobState
    reason: str
    requeue: bool = False  # its scheduler's allocation cannot carry it on: requeue it


Action = (
    PauseJob
    | ResumeJob
    | CheckpointJob
    | RestartJob
    | ReportStraggler
    | RefuseNode
    | DeclareLost
    | DrainNode
    | HoldNode
    | ResyncNode
    | Unheeded
    | FinishJob
)
