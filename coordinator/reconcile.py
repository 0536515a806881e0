"""Level-triggered reconciliation: the ranks a job expects against what its nodes report.

Each agent's heartbeat carries its authoritative set of ranks (``proto.node.RankReport``).
Every tick the leader compares it with what each job's current attempt expects, so a lost,
late or repeated ``worker.exited`` costs at most a heartbeat, never a stranded job:

- a rank the job expects that its node reports exited is an exit (the event may be lost);
- a rank the job expects that its live node does not report at all is missing: a failure,
  with that evidence;
- a live rank that no live attempt expects is an orphan, to be stopped.

A node's beat is evidence about an attempt only if its agent built it after it had
carried out that attempt's launch (:func:`knows_launch`): the beat names the attempt.
Neither when a beat arrives nor the agent's wall-clock stamp on it can say that: a beat
queued behind others is read late, and a clock stepped back makes an older beat look
newer than the launch's answer.

Pure: the caller passes the job records, the registry's nodes and which of them to trust.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from coordinator.registry import NodeInfo
from proto.job import JobRecord, JobState
from proto.node import RankReport

T = TypeVar("T")
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


def _hosted(job: JobRecord) -> tuple[int, int]:
    """Ranks per node, and how many ranks the current attempt has on its nodes."""
    per = max(1, job.spec.job.gpus_per_node)
    return per, min(job.world_size, len(job.nodes) * per)


def host_of(job: JobRecord, rank: int) -> str | None:
    """The node ``rank`` of the current attempt runs on (ranks are contiguous by node);
    None for a rank it does not have. Constant time: it is asked per event and per rank
    report, of jobs of up to hundreds of thousands of ranks."""
    per, ranks = _hosted(job)
    return job.nodes[rank // per] if 0 <= rank < ranks else None


def hosts_rank(job: JobRecord, node: str, rank: int, attempt: int) -> bool:
    """Whether ``node`` speaks for ``rank`` of ``job``'s current attempt (an attempt of 0,
    an unknown one, matches nothing)."""
    return attempt != 0 and attempt == job.attempt and host_of(job, rank) == node


def knows_launch(node: NodeInfo, job: str, attempt: int, answered_by: float) -> bool | None:
    """Whether ``node``'s newest beat was built after its agent had carried out the launch
    of ``attempt`` of ``job``, so that a rank of that attempt it does not list is not
    there: the beat names that attempt (or a later one) as launched, or it comes from an
    agent process started after the one that answered the launch (``answered_by``: that
    process's start, 0 when unknown), whose every beat is newer than the answer (a
    restarted agent that found none of the job's ranks alive names no attempt of it).
    None: the agent does not say (it sends no ``launched``), and the caller falls back
    on the clocks."""
    if node.launched is None:
        return None
    if node.launched.get(job, 0) >= attempt:
        return True
    return 0 < answered_by < node.agent_started_at


class Memo:
    """What a pass found on each node, and what it found it from. A node whose rank
    reports (``NodeInfo.ranks_version``: what each rank is, not its step) and whose job
    records are as they were is not looked at again: its findings are the same, so a pass
    costs what changed, not the job's hundreds of thousands of ranks. The caller clears
    it now and then for a full pass."""

    def __init__(self) -> None:
        self._seen: dict[Hashable, tuple[NodeInfo, Hashable, list[Any]]] = {}

    def on(self, where: Hashable, node: NodeInfo, key: Hashable) -> list[Any] | None:
        """What was found at ``where`` from ``node`` as ``key`` says it was; None: look."""
        seen = self._seen.get(where)
        return seen[2] if seen is not None and seen[0] is node and seen[1] == key else None

    def keep(self, where: Hashable, node: NodeInfo, key: Hashable, found: list[T]) -> list[T]:
        self._seen[where] = (node, key, found)
        return found

    def clear(self) -> None:
        self._seen.clear()


def job_findings(
    job: JobRecord,
    nodes: Mapping[str, NodeInfo],
    settled: Callable[[NodeInfo], bool],
    memo: Memo | None = None,
) -> list[Exited | Missing]:
    """Exits and missing ranks of ``job``'s current attempt. ``settled(node)``: the node is
    alive and its newest beat came late enough after the attempt launched to list it.
    Linear in the job's ranks; with ``memo``, in the ranks of nodes whose reports changed."""
    if job.state not in _RUNS or job.stopping_attempt or not job.attempt:
        return []
    known = set(job.exited_ranks)
    per, count = _hosted(job)
    found: list[Exited | Missing] = []
    for first in range(0, count, per):
        node_id = job.nodes[first // per]
        node = nodes.get(node_id)
        if node is None or not settled(node):
            continue
        if memo is None:
            found += _on_node(job, node, range(first, min(first + per, count)), known)
            continue
        key = (job.attempt, len(known), node.ranks_version)
        seen = memo.on((job.id, node_id), node, key)
        if seen is None:
            ranks = range(first, min(first + per, count))
            seen = memo.keep((job.id, node_id), node, key, _on_node(job, node, ranks, known))
        found += seen
    return found


def _on_node(
    job: JobRecord, node: NodeInfo, ranks: range, known: set[str]
) -> list[Exited | Missing]:
    reported = {r.rank: r for r in node.ranks if r.job == job.id and r.attempt == job.attempt}
    found: list[Exited | Missing] = []
    for rank in ranks:
        if str(rank) in known:
            continue
        report = reported.get(rank)
        if report is None:
            found.append(Missing(node.id, rank))
        elif not report.alive:
            found.append(Exited(node.id, report))
    return found


def orphans(
    jobs: Mapping[str, JobRecord],
    nodes: Mapping[str, NodeInfo],
    trusted: Callable[[NodeInfo], bool],
    memo: Memo | None = None,
) -> list[Orphan]:
    """Live ranks that nothing expects: of an unknown or ended job, of an attempt before
    the current one whose stop is not in flight, of an attempt given up (the job waits to
    relaunch), or on a node that does not host that rank. Judged once per job and attempt,
    then per rank only where it runs: linear in the reports; with ``memo``, in the
    reports of nodes whose reports changed (or every node's, when a job's did)."""
    found: list[Orphan] = []
    verdicts: dict[tuple[str, int], bool | None] = {}
    jobs_key = tuple((j.id, j.attempt, j.state, j.stopping_attempt) for j in jobs.values())
    for node in nodes.values():
        if not node.ranks or not trusted(node):
            continue
        if memo is None:
            found += _orphans_on(node, jobs, verdicts)
            continue
        key = (node.ranks_version, jobs_key)
        seen = memo.on(node.id, node, key)
        if seen is None:
            seen = memo.keep(node.id, node, key, _orphans_on(node, jobs, verdicts))
        found += seen
    return found


def _orphans_on(
    node: NodeInfo, jobs: Mapping[str, JobRecord], verdicts: dict[tuple[str, int], bool | None]
) -> list[Orphan]:
    found = []
    for report in node.ranks:
        if not report.alive:
            continue
        key = (report.job, report.attempt)
        if key not in verdicts:
            verdicts[key] = _unexpected(jobs.get(report.job), report.attempt)
        unexpected = verdicts[key]
        if unexpected is None:  # the current attempt's: on the node that hosts it?
            unexpected = host_of(jobs[report.job], report.rank) != node.id
        if unexpected:
            found.append(Orphan(node.id, report))
    return found


def _unexpected(job: JobRecord | None, attempt: int) -> bool | None:
    """Whether a live rank of ``attempt`` of ``job`` is unexpected wherever it runs; None
    when that depends on where (it is the current attempt's)."""
    if job is None or job.state.terminal:
        return True
    if attempt > job.attempt:
        return False  # newer than this leader's record: not ours to judge
    if attempt == job.stopping_attempt:
        return False  # its stop is under way
    if attempt < job.attempt or job.state in (JobState.PENDING, JobState.RECOVERING):
        return True
    return None


def peers_stepped_on(job: JobRecord, nodes: Mapping[str, NodeInfo], silent: str) -> bool:
    """Whether a rank of the current attempt on a node other than ``silent`` reports, in
    its node's beat, a step at least two past rank 0's newest word (``job.step``). No step
    completes without every rank's part in its collectives, so the silent node's ranks
    step too, even with rank 0 among them, whose word its node's agent relays. Two: the
    peers of a rank 0 that died with its agent may finish the step it did not report,
    never the one after."""
    per, count = _hosted(job)
    return any(
        r.job == job.id and r.attempt == job.attempt and r.last_step >= job.step + 2
        for node_id in set(job.nodes[: (count + per - 1) // per]) - {silent}  # those with ranks
        if (node := nodes.get(node_id)) is not None
        for r in node.ranks
    )
