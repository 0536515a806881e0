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

from collections.abc import Mapping, Sequence

from coordinator import loop_support, network_culprit, node_life
from coordinator.actions import (
    Action,
    DeclareLost,
    DrainNode,
    PauseJob,
    RestartJob,
    ResumeJob,
    ResyncNode,
    Unheeded,
)
from coordinator.job_machine import LIVE
from coordinator.progress_policy import all_exited
from proto.conditions import Condition, ConditionKind, Severity, condition_key
from proto.events import (
    ClockResyncFailed,
    EventBase,
    NodeAway,
    NodeLost,
    WorkerExited,
    WorkerHung,
)
from proto.job import Failure, JobRecord
from proto.progress import Reaction


def decide(
    job: JobRecord,
    event: EventBase,
    silent: frozenset[str] = frozenset(),
    *,
    progressing: bool = False,
    links: Mapping[str, Sequence[Condition]] | None = None,
) -> list[Action]:
    """The job's reaction to one event: its condition if it carries one, else its kind.
    ``silent``: nodes whose agents have missed a beat or did not answer a ping; a rank's
    exit that restarts the job excludes them, since a dead machine's peers exit first and
    its own loss is seconds away (one fault, one restart). ``progressing``: rank 0 reported
    a step within the last few heartbeats, so every rank is alive (they step together).
    ``links``: the open network conditions of the job's nodes (their links, and the peers
    each cannot reach), the evidence for a hang or failure no node can pin on a rank of
    its own (:mod:`coordinator.network_culprit`)."""
    if event.condition is not None:
        return on_condition(job, event.condition)
    if job.state not in LIVE or (event.node is not None and event.node not in job.nodes):
        return []
    if isinstance(event, WorkerExited) and event.job != job.id:
        return []  # another job's rank (or one naming no job): nothing to do with this one
    match event:
        case WorkerExited(attempt=attempt) if attempt != job.attempt:
            return []
        case WorkerExited(exit_code=0):
            return all_exited(job)
        case WorkerExited() if job.stopping:
            return all_exited(job)  # the operator's stop: how each rank ended is moot
        case WorkerExited(node=str(node), rank=rank):
            why = f"rank {rank} on {node} failed ({event.message})"
            gone = tuple(sorted(silent & set(job.nodes)))
            if gone:
                why += f"; {', '.join(gone)} silent, left out"
            # a collective's peer cut off from the rest fails the ranks waiting on it
            cut = {
                n: r for n, r in network_culprit.cut_off(job, links or {}).items() if n not in gone
            }
            if cut:
                why += "; " + "; ".join(f"{n}: {r}" for n, r in cut.items()) + ", left out"
                gone = tuple(sorted({*gone, *cut}))
            failure = Failure(node=node, rank=rank, cause=exit_cause(event), step=job.step)
            return [RestartJob(why, gone, failure)]
        case WorkerHung(attempt=attempt) if attempt != job.attempt:
            return []
        case WorkerHung(culprit_unknown=True, rank=rank, step=step) if (
            suspects := network_culprit.link_suspects(job, links or {})
            or network_culprit.cut_off(job, links or {})
        ):
            # Every stalled rank waits in a collective, and some node's network path is
            # faulty: that node is the culprit, not the one whose rank happened to report.
            said = "; ".join(f"{n}: {r}" for n, r in suspects.items())
            why = (
                f"rank {rank} on {event.node} and its peers wait in a collective after step "
                f"{step}, with a faulty network path on {said}; left out"
            )
            left_out = tuple(suspects)
            return [
                RestartJob(why, left_out, Failure(node=left_out[0], cause="network", step=job.step))
            ]
        case WorkerHung(node=str(node), rank=rank, step=step, evidence=evidence):
            why = f"rank {rank} on {node} hung after step {step} ({evidence})"
            repeated = len(hangs := job.hung_at.get(node, [])) >= 2
            if repeated:
                window = node_life.REPEAT_WINDOW_S
                why += f"; {node} hung {len(hangs)} times within {window:g} s, left out"
            failure = Failure(node=node, rank=rank, cause="hang", step=job.step)
            return [RestartJob(why, (node,) if repeated else (), failure)]
        case NodeAway() if progressing:
            # Its agent is silent but the ranks still step together, so its ranks are
            # alive: a dead or restarting agent is no reason to throw work away (nor to
            # call the node lost: it stays away until it beats again).
            return []
        case NodeAway() if not loop_support.reports_steps(job):
            # A script that reports no steps gives no evidence either way, and its ranks
            # outlive a restarting agent: the node's grace decides (node.lost, below).
            return []
        case NodeLost(node=str(node)) if not loop_support.reports_steps(job):
            failure = Failure(node=node, cause="node lost", step=job.step)
            return [RestartJob(f"node {node} lost", (node,), failure)]
        case NodeAway(node=str(node)):
            # lost, it is drained while it stays lost (coordinator.node_life)
            failure = Failure(node=node, cause="node lost", step=job.step)
            why = f"the ranks of {job.id} stopped stepping"
            return [DeclareLost(node, why), RestartJob(f"node {node} lost", (node,), failure)]
        case ClockResyncFailed(node=str(node), offset_after_ms=after) if (
            event.offset_measured and abs(after) > job.spec.policy.clock_max_offset_ms
        ):
            # Only a measured offset beyond the limit is evidence: a resync that failed
            # for want of a tool, on a clock measured in bounds, is the event's warning.
            limit = job.spec.policy.clock_max_offset_ms
            why = f"clock on {node} still {after:+.1f} ms off (limit {limit:g} ms) after a resync"
            failure = Failure(node=node, cause="clock", step=job.step)
            key = condition_key(ConditionKind.CLOCK, node)
            return [DrainNode(node, key, why), RestartJob(why, (node,), failure)]
    return []


def exit_cause(event: WorkerExited) -> str:
    if event.exit_code is not None:
        return f"exit {event.exit_code}"
    return f"signal {event.signal}" if event.signal else "exit unknown"


def on_condition(job: JobRecord, cond: Condition) -> list[Action]:
    """A condition opened or closed (or changed severity while open)."""
    if job.state.terminal:
        return []
    if not cond.active:
        return _release(job, cond)  # a reason closes whatever state the job is in
    if cond.kind is ConditionKind.OPERATOR:
        return _hold(job, cond, "operator request") if cond.job == job.id else []
    # a node left out is in no attempt's nodes; one that came back speaks for itself again
    if job.state not in LIVE or cond.node not in job.nodes:
        return []
    # The agent's detector judged the threshold (its nvme.spike_us, gpu.critical_c): the
    # condition and its severity are the evidence, not a second threshold per job.
    node = cond.node
    match cond.kind:
        case ConditionKind.NVME_LATENCY:
            at = f" at {cond.value:.0f} µs" if cond.value is not None else ""
            return _hold(job, cond, f"NVMe {cond.subject} on {node}{at}")
        case ConditionKind.NVME_READONLY:
            return _evacuate(job, node, f"NVMe {cond.subject} on {node} turned read-only")
        case ConditionKind.NET_LINK:
            # The ranks' collectives cross this link: none reaches the next step boundary,
            # so waiting there for a checkpoint would only spend the stop's grace.
            why = f"data link down on {node}: {cond.reason or cond.subject}"
            return _evacuate(job, node, why, graceful=False)
        case ConditionKind.PREEMPTION:
            return _evacuate(job, node, f"preemption notice on {node} ({cond.subject})")
        case ConditionKind.GPU_THERMAL if cond.severity is Severity.CRITICAL:
            # critical: at the agent's gpu.critical_c, or a hardware thermal slowdown below it
            why = f"GPU {cond.subject} on {node}: {cond.reason or 'critical temperature'}"
            return _evacuate(job, node, why)
    return []


def on_operator_drain(job: JobRecord, node: str, why: str) -> list[Action]:
    """An operator drained ``node``: a live job with ranks there moves off it as from a
    critical fault, checkpoint first where its loop can. Nothing failed, so no restart is
    spent and the job leaves the node out only while it is drained: an undrain returns it
    to the job's placement at once."""
    if job.state not in LIVE or node not in job.nodes or job.stopping:
        return []
    why, graceful = _checkpoint_first(job, f"{node} drained: {why}", True)
    return [RestartJob(why, graceful=graceful)]


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
    if loop_support.lacking(job, Reaction.CHECKPOINT) is not None:
        return None  # nobody could take those checkpoints
    return max(notice, took)


def operator_key(job_id: str) -> str:
    return condition_key(ConditionKind.OPERATOR, job=job_id)


def _hold(job: JobRecord, cond: Condition, reason: str) -> list[Action]:
    if cond.key in job.pause_reasons or cond.key in job.unheeded:
        return []
    if (why := loop_support.lacking(job, Reaction.PAUSE)) is not None:
        return [Unheeded(cond.key, Reaction.PAUSE.value, reason, why)]
    reasons = (*job.pause_reasons, cond.key)
    return [PauseJob(cond.key, reason, reasons, send=not job.pause_reasons)]


def _release(job: JobRecord, cond: Condition) -> list[Action]:
    if cond.key in job.unheeded:
        return [Unheeded(cond.key, Reaction.PAUSE.value, cond.reason, "", opened=False)]
    if cond.key not in job.pause_reasons:
        return []
    reasons = tuple(r for r in job.pause_reasons if r != cond.key)
    why = cond.reason or f"{cond.key} closed"
    return [ResumeJob(cond.key, why, reasons, send=not reasons and job.state in LIVE)]


def _evacuate(job: JobRecord, node: str, why: str, *, graceful: bool = True) -> list[Action]:
    """Continue without the node (drained by its critical condition meanwhile:
    :mod:`coordinator.node_life`), by default from a checkpoint of the step the ranks are
    at (a graceful restart: nothing is lost while the node still runs); not graceful: from
    the newest checkpoint, where the ranks cannot reach a step boundary."""
    failure = Failure(node=node, cause="evacuated", step=job.step)
    why, graceful = _checkpoint_first(job, why, graceful)
    return [RestartJob(why, (node,), failure, graceful=graceful)]


def _checkpoint_first(job: JobRecord, why: str, graceful: bool) -> tuple[str, bool]:
    """A stop at a boundary with a checkpoint first is not the loop's to make where it
    cannot checkpoint: say so, and spend no grace waiting for it."""
    if graceful and (lacks := loop_support.lacking(job, Reaction.CHECKPOINT)) is not None:
        return f"{why}; no checkpoint first: {lacks}", False
    return why, graceful
