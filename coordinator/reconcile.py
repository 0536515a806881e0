"""Level-triggered reconciliation: the ranks a job expects against what its nodes report.

Each agent's heartbeat carries its authoritative set of ranks (``proto.node.RankReport``).
Every tick the leader compares it with what each job's current attempt expects, so a lost,
late or repeated ``worker.exited`` costs at most a heartbeat, never a stranded job:

- a rank the job expects that its node reports exited is an exit (the event may be lost);
- a rank the job expects that its live node does not report at all is missing: a failure,
  with that evidence;
- a live rank that no live attempt expects is an orphan, to be stopped.

Pure: the caller passes the job records, the registry's nodes and which of them to trust.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coordinator.registry import NodeInfo
from proto.job import JobRecord, JobState
from proto.node import RankReport

_RUNS = frozenset({JobState.STARTING, JobState.RUNNING, JobState.PAUSED, JobState.CHECKPOINTING})


@dataclass(frozen=True)
class Exited:
    """Rank ``rank`` of the current attempt exited, as ``node`` reports it."""

    node: str
    report: RankReport


@dataclass(frozen=True)
class Missing:
    """``node`` is alive but reports no rank ``rank`` of the current attempt."""

    node: str
    rank: int


@dataclass(frozen=True)
class Orphan:
    """A live rank on ``node`` that no live attempt of its job expects."""

    node: str
    report: RankReport


def hosts(job: JobRecord) -> dict[int, str]:
    """Each rank of the current attempt and the node it runs on (ranks are contiguous)."""
    per = max(1, job.spec.job.gpus_per_node)
    return {
        rank: job.nodes[rank // per] for rank in range(min(job.world_size, len(job.nodes) * per))
    }


def hosts_rank(job: JobRecord, node: str, rank: int, attempt: int) -> bool:
    """Whether ``node`` speaks for ``rank`` of ``job``'s current attempt (an attempt of 0,
    an unknown one, matches nothing)."""
    return attempt != 0 and attempt == job.attempt and hosts(job).get(rank) == node


def job_findings(
    job: JobRecord, nodes: Mapping[str, NodeInfo], settled: Callable[[NodeInfo], bool]
) -> list[Exited | Missing]:
    """Exits and missing ranks of ``job``'s current attempt. ``settled(node)``: the node is
    alive and its newest beat came late enough after the attempt launched to list it."""
    if job.state not in _RUNS or job.stopping_attempt or not job.attempt:
        return []
    known = set(job.exited_ranks)
    found: list[Exited | Missing] = []
    for rank, node_id in hosts(job).items():
        node = nodes.get(node_id)
        if node is None or not settled(node) or str(rank) in known:
            continue
        report = next(
            (
                r
                for r in node.ranks
                if r.job == job.id and r.rank == rank and r.attempt == job.attempt
            ),
            None,
        )
        if report is None:
            found.append(Missing(node_id, rank))
        elif not report.alive:
            found.append(Exited(node_id, report))
    return found


def orphans(
    jobs: Mapping[str, JobRecord],
    nodes: Mapping[str, NodeInfo],
    trusted: Callable[[NodeInfo], bool],
) -> list[Orphan]:
    """Live ranks that nothing expects: of an unknown or ended job, of an attempt before
    the current one whose stop is not in flight, of an attempt given up (the job waits to
    relaunch), or on a node that does not host that rank."""
    found = []
    for node in nodes.values():
        if not node.ranks or not trusted(node):
            continue
        for report in node.ranks:
            if report.alive and _unexpected(jobs.get(report.job), node.id, report):
                found.append(Orphan(node.id, report))
    return found


def _unexpected(job: JobRecord | None, node: str, report: RankReport) -> bool:
    if job is None or job.state.terminal:
        return True
    if report.attempt > job.attempt:
        return False  # newer than this leader's record: not ours to judge
    if report.attempt == job.stopping_attempt:
        return False  # its stop is under way
    if report.attempt < job.attempt or job.state in (JobState.PENDING, JobState.RECOVERING):
        return True
    return hosts(job).get(report.rank) != node


def peers_stepped_on(job: JobRecord, nodes: Mapping[str, NodeInfo], silent: str) -> bool:
    """Whether a rank of the current attempt on a node other than ``silent`` reports, in
    its node's beat, a step at least two past rank 0's newest word (``job.step``). No step
    completes without every rank's part in its collectives, so the silent node's ranks
    step too, even with rank 0 among them, whose word its node's agent relays. Two: the
    peers of a rank 0 that died with its agent may finish the step it did not report,
    never the one after."""
    ranks = hosts(job)
    return any(
        r.job == job.id and r.attempt == job.attempt and r.last_step >= job.step + 2
        for node_id in set(ranks.values()) - {silent}
        if (node := nodes.get(node_id)) is not None
        for r in node.ranks
    )
