"""Which of a job's nodes the network makes the culprit of a hang or a rank's failure
that no node can pin on a rank of its own: pure, from the open network conditions of the
job's nodes (their links, and the peers each cannot reach: ``net.peer``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from coordinator.goodput import stall_threshold
from proto.conditions import LINK_KINDS, Condition, ConditionKind
from proto.job import JobRecord, JobState


def link_suspects(job: JobRecord, links: Mapping[str, Sequence[Condition]]) -> dict[str, str]:
    """The job's nodes with an open link condition, by name, with what it says."""
    found = {}
    for node in sorted(job.nodes):
        conds = [c for c in links.get(node, ()) if c.kind in LINK_KINDS]
        if conds:
            found[node] = ", ".join(c.reason or f"{c.kind} {c.subject}" for c in conds)
    return found


def cut_off(job: JobRecord, links: Mapping[str, Sequence[Condition]]) -> dict[str, str]:
    """The job's nodes that most of its other nodes cannot reach (``net.peer``), by
    name, with who says so. When the split is even (two nodes that cannot reach each
    other, two halves), nothing tells a culprit from its peer: the nodes that rank 0's
    node cannot reach are left out, the side away from the rendezvous, so the job goes
    on with the master's side and spares."""
    said: dict[str, list[Condition]] = {}
    for reporter in job.nodes:
        for c in links.get(reporter, ()):
            if c.kind is ConditionKind.NET_PEER and c.subject in job.nodes and c.node != c.subject:
                said.setdefault(c.subject, []).append(c)
    others = len(job.nodes) - 1
    found = {
        node: "unreachable from " + "; ".join(f"{c.node} ({c.reason})" for c in conds)
        for node, conds in sorted(said.items())
        if len({c.node for c in conds}) > others / 2
    }
    if 2 * len(found) < len(job.nodes):
        return found
    master = job.nodes[0]
    return {
        c.subject: f"cannot reach rank 0's node {master} nor it them ({c.reason}): an even "
        f"split, the side away from the rendezvous left out"
        for c in links.get(master, ())
        if c.kind is ConditionKind.NET_PEER and c.subject in job.nodes and c.subject != master
    }


def suspects(job: JobRecord, links: Mapping[str, Sequence[Condition]]) -> dict[str, str]:
    """The nodes the network makes the culprit of a stall, by name, with the evidence."""
    return link_suspects(job, links) or cut_off(job, links)


def stalled_cut_off(
    job: JobRecord, links: Mapping[str, Sequence[Condition]], now: float
) -> tuple[float, dict[str, str]] | None:
    """A start or a run that made no step for the stall threshold while most of the job's
    other nodes cannot reach one of its nodes: the seconds without a step, and the nodes
    cut off with who says so. Level-triggered: whatever was decided before the network's
    word came (a hang with no culprit decided as a plain hang, a start waiting on a
    rendezvous the node cannot reach), the job does not stay stuck with that node. A job
    whose ranks step is left alone, whatever the probes say."""
    if job.state not in (JobState.STARTING, JobState.RUNNING) or job.stopping:
        return None
    since = max(job.last_step_at or 0.0, job.attempt_started_at or 0.0)
    if not since or now - since < stall_threshold(job):
        return None
    cut = cut_off(job, links)
    return (now - since, cut) if cut else None
