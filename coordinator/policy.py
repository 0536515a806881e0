"""Fault policy: pure functions from (job, condition or event) to actions. No I/O; the job
manager applies the actions. Thresholds come from the job's ``[policy]`` section.

Conditions (:mod:`proto.conditions`) are what agents latch open and closed and what an
operator's pause is; the policy answers each opening and closing. Pauses are held by
condition key: a job is paused while any of its pause reasons is open (an NVMe device in a
latency spike, an operator's pause) and resumes when the last one closes, so overlapping
faults never resume the job early. The reasons are computed here and nowhere else: a
:class:`PauseJob` or :class:`ResumeJob` carries the job's reasons after it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from proto.conditions import Condition, ConditionKind, Severity, condition_key
from proto.events import ClockResynced, EventBase, NodeLost, WorkerExited, WorkerHung
from proto.job import JobRecord, JobState
from proto.progress import BandwidthChecked, Rewound, Stragglers, slow_nodes

LIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.PAUSED, JobState.CHECKPOINTING})


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
    """Restart without ``exclude``; ``charged``: the restart counts against the job's
    ``max_restarts`` (not when nothing trained yet and no fault struck, as after a
    preflight refusal); ``graceful``: the ranks stop at the next step boundary with a
    checkpoint first, so the next attempt resumes from exactly that step (an evacuation
    with notice, a replacement, growing back) instead of being killed at once."""

    reason: str
    exclude: tuple[str, ...] = ()
    charged: bool = True
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


Action = (
    PauseJob
    | ResumeJob
    | CheckpointJob
    | RestartJob
    | ReportStraggler
    | RefuseNode
    | DrainNode
    | ResyncNode
    | FinishJob
)


def decide(
    job: JobRecord,
    event: EventBase,
    silent: frozenset[str] = frozenset(),
    *,
    progressing: bool = False,
) -> list[Action]:
    """The job's reaction to one event: its condition if it carries one, else its kind.
    ``silent``: nodes whose agents have missed a beat or did not answer a ping; a rank's
    exit that restarts the job excludes them, since a dead machine's peers exit first and
    its own loss is seconds away (one fault, one restart). ``progressing``: rank 0 reported
    a step within the last few heartbeats, so every rank is alive (they step together)."""
    if event.condition is not None:
        return on_condition(job, event.condition)
    if job.state not in LIVE or (event.node is not None and event.node not in job.nodes):
        return []
    if isinstance(event, WorkerExited) and event.job != job.id:
        return []  # another job's rank (or one naming no job): nothing to do with this one
    match event:
        case WorkerExited(attempt=attempt) if attempt != job.attempt or job.stopping:
            return all_exited(job) if job.stopping and attempt == job.attempt else []
        case WorkerExited() if job.finished:
            # Rank 0 already reported the end (its final checkpoint is durable): a rank
            # dying during teardown loses nothing, so it is no reason to restart.
            return all_exited(job)
        case WorkerExited(node=node, rank=rank, exit_code=code) if code != 0:
            why = f"rank {rank} on {node} failed ({event.message})"
            gone = tuple(sorted(silent & set(job.nodes)))
            if gone:
                why += f"; {', '.join(gone)} silent, left out"
            return _restart_or_fail(job, why, gone)
        case WorkerExited():
            return all_exited(job)
        case WorkerHung(attempt=attempt) if attempt != job.attempt:
            return []
        case WorkerHung(node=str(node), rank=rank, step=step, evidence=evidence):
            why = f"rank {rank} on {node} hung after step {step} ({evidence})"
            repeated = job.hangs.get(node, 0) >= 2
            if repeated:
                why += f"; {node} hung {job.hangs[node]} times, left out"
            return _restart_or_fail(job, why, (node,) if repeated else ())
        case NodeLost() if progressing:
            # Its agent is silent but the ranks still step together, so its ranks are
            # alive: a dead or restarting agent is no reason to throw work away.
            return []
        case NodeLost(node=str(node)):
            return [
                DrainNode(node, "heartbeat lost"),
                *_restart_or_fail(job, f"node {node} lost", (node,)),
            ]
        case ClockResynced(node=str(node), ok=False, offset_after_ms=after) if (
            event.offset_measured and abs(after) > job.spec.policy.clock_max_offset_ms
        ):
            # Only a measured offset beyond the limit is evidence: a resync that failed
            # for want of a tool, on a clock measured in bounds, is the event's warning.
            limit = job.spec.policy.clock_max_offset_ms
            why = f"clock on {node} still {after:+.1f} ms off (limit {limit:g} ms) after a resync"
            return [DrainNode(node, why), *_restart_or_fail(job, why, (node,))]
    return []


def on_condition(job: JobRecord, cond: Condition) -> list[Action]:
    """A condition opened or closed (or changed severity while open)."""
    if job.state.terminal:
        return []
    if not cond.active:
        return _release(job, cond)  # a reason closes whatever state the job is in
    if cond.kind is ConditionKind.OPERATOR:
        return _hold(job, cond, "operator request") if cond.job == job.id else []
    if job.state not in LIVE or cond.node not in job.nodes or cond.node in job.excluded:
        return []
    pol, node = job.spec.policy, cond.node
    match cond.kind:
        case ConditionKind.NVME_LATENCY if (cond.value or 0.0) >= pol.nvme_pause_us:
            return _hold(job, cond, f"NVMe {cond.subject} on {node} at {cond.value:.0f} µs")
        case ConditionKind.NVME_READONLY:
            return _evacuate(job, node, f"NVMe {cond.subject} on {node} turned read-only")
        case ConditionKind.PREEMPTION:
            return _evacuate(job, node, f"preemption notice on {node} ({cond.subject})")
        case ConditionKind.GPU_THERMAL if (
            cond.severity is Severity.CRITICAL or (cond.value or 0.0) >= pol.gpu_critical_c
        ):
            # critical: at the threshold, or a hardware thermal slowdown below it
            why = f"GPU {cond.subject} on {node}: {cond.reason or 'critical temperature'}"
            return _evacuate(job, node, why)
    return []


def on_bandwidth(job: JobRecord, msg: BandwidthChecked) -> list[Action]:
    """Rank 0's preflight bandwidth figures, before the first step: refuse every node of
    the job under ``min_bandwidth_ratio`` × the median of its peers and restart without
    them. The restart is not charged to the budget: nothing trained and nothing failed,
    and each refusal shrinks the nodes a job can be admitted to, so it cannot loop. The
    node is not drained: other jobs may not need its bandwidth."""
    if job.state is not JobState.STARTING:
        return []  # a late message from an earlier attempt, or the job moved on
    ratio = job.spec.policy.min_bandwidth_ratio
    slow = {
        node: median
        for node, median in slow_nodes(msg.node_gbps, ratio).items()
        if node in job.nodes
    }
    reasons = {
        node: f"{node} bus bandwidth {msg.node_gbps[node]:.1f} GB/s, under {ratio:g} × "
        f"the median {median:.1f} GB/s of its peers"
        for node, median in sorted(slow.items())
    }
    if not reasons:
        return []
    return [
        *(RefuseNode(node, why) for node, why in reasons.items()),
        RestartJob("; ".join(reasons.values()), tuple(reasons), charged=False),
    ]


def on_node_condition(cond: Condition) -> list[Action]:
    """Reactions that concern a node whether or not it hosts a job."""
    if cond.kind is ConditionKind.CLOCK and cond.active:
        return [ResyncNode(cond.node, cond.reason or "clock out of bounds")]
    return []


def relaunched(job: JobRecord, active: dict[str, Condition]) -> list[Action]:
    """A new attempt's ranks start unpaused: reasons whose condition is no longer open
    (``active``: every open condition on the job's new nodes, by key) are released, and if
    any reason still holds, rank 0 is told to pause again."""
    kept = tuple(key for key in job.pause_reasons if key in active or key == operator_key(job.id))
    actions: list[Action] = [
        ResumeJob(key, "not on this attempt's nodes", kept, send=False)
        for key in job.pause_reasons
        if key not in kept
    ]
    if kept:
        actions.append(PauseJob(kept[0], f"held by {', '.join(kept)}", kept, send=True))
    return actions


def minimum_nodes(job: JobRecord) -> int:
    """The fewest nodes the job's next attempt may run on: ``[job] min_nodes`` once it has
    run (a first start waits for all its nodes), unless its checkpoints cannot load at
    another world size (DeepSpeed ZeRO-0 and ZeRO-3 partition what they save by it)."""
    spec = job.spec
    if not job.attempt or spec.job.min_nodes is None:
        return spec.job.nodes
    if not spec.job.entry and spec.train.engine == "deepspeed" and spec.train.zero_stage in (0, 3):
        return spec.job.nodes
    return spec.job.min_nodes


def at_risk(job: JobRecord, node: str, window_s: float) -> str | None:
    """Why a preemption notice of ``window_s`` seconds on ``node`` may cost the job work:
    shorter than one step plus its measured checkpoint time. None: it fits (or nothing
    was measured yet: a missing figure is no evidence)."""
    if job.state not in LIVE or node not in job.nodes or job.checkpoint_s is None:
        return None
    if window_s >= job.checkpoint_s:
        return None
    since = job.last_checkpoint_step
    return (
        f"preemption of {node} in {window_s:.1f} s, shorter than the job's measured checkpoint "
        f"time {job.checkpoint_s:.1f} s: the work since "
        + (f"step {since}" if since is not None else "the start")
        + " may be lost"
    )


def bounded_cadence(job: JobRecord) -> float | None:
    """Seconds between the checkpoints that bound what a preemption notice can cost, when
    the job's measured checkpoint time exceeds ``policy.preemption_notice_s``; None when a
    notice leaves time to checkpoint (or nothing is measured or expected)."""
    notice, took = job.spec.policy.preemption_notice_s, job.checkpoint_s
    if notice is None or took is None or took <= notice:
        return None
    return max(notice, took)


def waited_too_long(job: JobRecord, now: float) -> list[Action]:
    """A job that cannot run (too few healthy nodes) fails after ``wait_for_nodes_s``
    with the reason it waited for, instead of waiting forever."""
    limit = job.spec.policy.wait_for_nodes_s
    if job.waiting_since is None or now - job.waiting_since < limit:
        return []
    why = job.reason or "not enough healthy nodes"
    return [FinishJob(JobState.FAILED, f"gave up after {limit:g} s {why}")]


def operator_key(job_id: str) -> str:
    return condition_key(ConditionKind.OPERATOR, job=job_id)


def _hold(job: JobRecord, cond: Condition, reason: str) -> list[Action]:
    if cond.key in job.pause_reasons:
        return []
    reasons = (*job.pause_reasons, cond.key)
    return [PauseJob(cond.key, reason, reasons, send=not job.pause_reasons)]


def _release(job: JobRecord, cond: Condition) -> list[Action]:
    if cond.key not in job.pause_reasons:
        return []
    reasons = tuple(r for r in job.pause_reasons if r != cond.key)
    why = cond.reason or f"{cond.key} closed"
    return [ResumeJob(cond.key, why, reasons, send=not reasons and job.state in LIVE)]


def _evacuate(job: JobRecord, node: str, why: str) -> list[Action]:
    """Take the node out and continue without it, from a checkpoint of the step the ranks
    are at (a graceful restart: nothing is lost while the node still runs)."""
    return [DrainNode(node, why), *_restart_or_fail(job, why, (node,), graceful=True)]


def _restart_or_fail(
    job: JobRecord, reason: str, exclude: tuple[str, ...], *, graceful: bool = False
) -> list[Action]:
    if job.restarts_in_row >= job.spec.policy.max_restarts:
        spent = f"restart budget of {job.restarts_in_row} spent"
        if job.restarts_in_row:
            spent += f" (restarts in a row without training past step {job.failing_at_step})"
        return [FinishJob(JobState.FAILED, f"{reason}; {spent}")]
    return [RestartJob(reason, exclude, graceful=graceful)]


def on_rewound(job: JobRecord, msg: Rewound) -> list[Action]:
    """The ranks went back to a good checkpoint after a numeric fault (``job.rewinds``
    already counts it): past ``max_rewinds`` the job fails with the evidence."""
    limit = job.spec.policy.max_rewinds
    if job.rewinds <= limit:
        return []
    return [
        FinishJob(
            JobState.FAILED,
            f"numeric fault at step {msg.from_step} ({msg.reason}); "
            f"{job.rewinds} rewinds, over the limit of {limit}",
        )
    ]


def on_stragglers(job: JobRecord, msg: Stragglers, reported: set[int]) -> list[Action]:
    """Ranks slower than ``straggler_ratio`` × their peers' median over the window
    (``reported``: ranks already reported this attempt). With spares, the first
    straggler's node is replaced gracefully (uncharged: nothing failed)."""
    if job.state is not JobState.RUNNING or job.world_size != len(msg.rank_step_s):
        return []
    pol, per_node = job.spec.policy, job.spec.job.gpus_per_node
    actions: list[Action] = []
    for rank, (seconds, median) in sorted(stragglers(msg.rank_step_s, pol.straggler_ratio).items()):
        if rank in reported or rank // per_node >= len(job.nodes):
            continue
        node = job.nodes[rank // per_node]
        actions.append(ReportStraggler(node, rank, seconds, median))
        if job.spec.job.spares and not any(isinstance(a, RestartJob) for a in actions):
            why = f"rank {rank} on {node} straggles: {seconds:.3f} s/step vs {median:.3f} s"
            actions.append(RestartJob(why, (node,), charged=False, graceful=True))
    return actions


def stragglers(rank_step_s: list[float], ratio: float) -> dict[int, tuple[float, float]]:
    """Ranks whose time is over ``ratio`` × the median of the others', with that median."""
    slow = {}
    for rank, seconds in enumerate(rank_step_s):
        peers = [s for r, s in enumerate(rank_step_s) if r != rank and s > 0]
        if peers and seconds > ratio * (median := statistics.median(peers)):
            slow[rank] = (seconds, median)
    return slow


def all_exited(job: JobRecord) -> list[Action]:
    """Every rank of the current attempt has exited (cleanly, or on our stop). Rank 0's
    last progress may still be in flight (it travels on another stream), so an unexplained
    early exit is left to :func:`overdue`. A job being restarted is not finishing: its
    ranks stopping (gracefully, with rank 0's "stopped") is the restart's own doing."""
    if job.state not in LIVE or len(job.exited_ranks) < job.world_size:
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
