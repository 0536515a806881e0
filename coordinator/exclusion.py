"""Nodes left out of a job after a fault, and how they come back. Pure: callers pass the
time and what the registry knows.

A node is left out for ``policy.exclude_s``, twice as long each time it faults again
within one such period of coming back (backoff), and is eligible again sooner once its
agent starts anew and reports healthy (a repaired machine, a restarted daemon whose
preflight passed): the evidence that left it out came from the process that is gone. A
node its own life drained since (:mod:`coordinator.node_life`: the critical condition or
the loss that left it out, a preemption notice that passed) is eligible again as soon as
that life returns it: the probation it served is the evidence that it is well, and
leaving it out longer would shrink the job for nothing.

The hangs that leave a node out are counted here too: two of its ranks' hangs within an
hour (:data:`coordinator.node_life.REPEAT_WINDOW_S`, the window of every node's repeats).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from coordinator.node_life import REPEAT_WINDOW_S
from coordinator.registry import NodeInfo
from proto.job import Exclusion, JobRecord

MAX_DOUBLINGS = 5  # at most 32 × exclude_s


def hung(job: JobRecord, node: str, now: float) -> None:
    """A hang of ``node``'s ranks in ``job``'s current attempt: on record with its hangs
    of the last hour, the ones that count (two leave it out: :func:`coordinator.policy.
    decide`)."""
    recent = [t for t in job.hung_at.get(node, []) if now - t <= REPEAT_WINDOW_S]
    job.hung_at[node] = [*recent, now]


def leave_out(job: JobRecord, node: str, reason: str, now: float, info: NodeInfo | None) -> None:
    """Leave ``node`` out of ``job`` for ``reason`` (``info``: what the registry knows of
    it). Twice as long as the last time when it faults again within one such period of
    coming back; afresh when its own life returned it since (drained for a cause, its
    probation served: its life counts the repeats that matter, three of a kind in an hour
    holding it, and a preemption notice that passed is no fault of the node)."""
    base = job.spec.policy.exclude_s
    prev = job.excluded.get(node)
    started = info.agent_started_at if info is not None else 0.0
    returned = info is not None and prev is not None and (info.serving_since or 0.0) > prev.since
    count = 1
    soon = prev is not None and now - prev.until < base * 2 ** min(prev.count, MAX_DOUBLINGS)
    if prev is not None and soon and not returned:
        count = prev.count + 1  # it faults again soon after it came back
    span = base * 2 ** min(count - 1, MAX_DOUBLINGS)
    job.excluded[node] = Exclusion(
        reason=reason, since=now, until=now + span, count=count, agent_started_at=started
    )


def left_out(job: JobRecord, nodes: Mapping[str, NodeInfo], now: float) -> dict[str, str]:
    """The nodes still left out of ``job`` now, each with why and until when; outside
    the scheduler's allocation it was started in, every node; outside any allocation, a
    node drained in Slurm by someone else (Slurm will not give it)."""
    out = {}
    if (alloc := job.allocation) is not None:
        hosts = set(alloc.hosts)
        for node_id, info in nodes.items():
            if node_id not in hosts and info.hostname.split(".")[0] not in hosts:
                out[node_id] = f"outside Slurm job {alloc.job_id}'s allocation"
    else:
        for node_id, info in nodes.items():
            if info.slurm_drain:
                out[node_id] = f"drained in Slurm ({info.slurm_drain})"
    for node_id, ex in job.excluded.items():
        node = nodes.get(node_id)
        back = (
            node is not None
            and node.healthy
            and node.preflight_ok
            # its agent started anew, or its life drained and returned it, since
            and (
                node.agent_started_at > ex.agent_started_at
                or (node.serving_since or 0.0) > ex.since
            )
        )
        if now < ex.until and not back:
            out[node_id] = f"left out after a fault in this job ({ex.reason}) until {_at(ex.until)}"
    return out


def _at(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%H:%M:%S UTC")
