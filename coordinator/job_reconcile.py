"""The job manager's reconciliation each tick.

What to do is :mod:`coordinator.reconcile`'s (pure); this hands its findings to the
manager (:class:`Findings`): the exits whose events were missed, to be published, so
on-call sees the evidence, and taken as those events; and orphans to stop, at most once
per ``ORPHAN_RETRY_S`` each. It reads the jobs, the registry's nodes and the launcher's
stamps, and writes none of them.

An exit a beat lists is the agent's own ``worker.exited`` too, sent first but on the events
stream, which a busy leader may read after the beat: it is reconciled only once listed for
over ``LASTING_BEATS`` beat intervals, so the fact is recorded once, from the agent, and a
lost event still costs at most that long.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, Protocol, TypeVar

import structlog

from coordinator.launch import Launcher
from coordinator.reconcile import Exited, Memo, Missing, job_findings, knows_launch, orphans
from coordinator.registry import NodeInfo, Registry
from proto.events import Severity, WorkerExited
from proto.job import JobRecord
from proto.node import RankReport
from ringmaster.clock import Clock

log = structlog.get_logger()
ORPHAN_RETRY_S = 10.0
# s: between full passes; in between, a node is looked at again only when its rank reports
# or its jobs changed (coordinator.reconcile.Memo), which is what the findings depend on
FULL_PASS_S = 10.0
LASTING_BEATS = 1.5  # beat intervals a finding must last before it is acted on
K = TypeVar("K")


class FirstSeen(Generic[K]):
    """When each finding of the ticks was first made, for as long as every tick makes it
    again: a beat can show what is already on its way to being true (a rank its stop has
    just ended, an exit whose own event is still in flight), so such a finding is acted
    on only once it has lasted :data:`LASTING_BEATS` beats."""

    def __init__(self) -> None:
        self.first: dict[K, float] = {}  # the findings of the last finished tick
        self._tick: dict[K, float] = {}

    def lasted(self, key: K, now: float, interval_s: float) -> bool:
        self._tick[key] = first = self.first.get(key, now)
        return now - first > LASTING_BEATS * interval_s

    def tick_done(self) -> None:
        """What this tick did not find again is forgotten."""
        self.first, self._tick = self._tick, {}

    def clear(self) -> None:
        self.first, self._tick = {}, {}


class Findings(Protocol):
    """What the job manager does with what a pass finds, as it finds it: an exit taken may
    restart its job, and what the pass looks at next sees that."""

    async def missed_exit(self, event: WorkerExited) -> None:
        """A rank's exit the beats show and no event brought."""

    def stop_orphan(self, node: str, report: RankReport, why: str) -> None:
        """A live rank on ``node`` that nothing expects: killed, as a task."""


class Reconciler:
    def __init__(self, registry: Registry, launcher: Launcher, clock: Clock) -> None:
        self.registry, self.launcher, self.clock = registry, launcher, clock
        self.since = (
            self.clock.monotonic()
        )  # when this leader took over: beats before it prove nothing
        self._orphans_stopped: dict[tuple[str, str, int], float] = {}
        self._orphans_seen = FirstSeen[tuple[str, str, int]]()  # (node, job, attempt)
        self._exits_seen = FirstSeen[tuple[str, int, int]]()  # (job, attempt, rank)
        self._findings, self._orphans = Memo(), Memo()
        self._full_at = -float("inf")

    def reset(self) -> None:
        self.since = self.clock.monotonic()
        self._full_at = -float("inf")
        self._orphans_stopped.clear()
        self._orphans_seen.clear()
        self._exits_seen.clear()

    async def reconcile(self, jobs: Mapping[str, JobRecord], out: Findings) -> None:
        now = self.clock.monotonic()
        nodes = self.registry.nodes
        if now - self._full_at >= FULL_PASS_S:
            self._full_at = now
            self._findings.clear()
            self._orphans.clear()
        # only nodes that run ranks or host a job can matter here: not a scan of them all
        hosting = {n for job in jobs.values() for n in job.nodes}
        ranked = {i: nodes[i] for i in self.registry.ranked if i in nodes}
        silent = self.registry.silent(list(hosting.union(ranked)), now)
        for job in list(jobs.values()):
            attempt, launched = self.launcher.launched_at.get(job.id, (0, self.since))
            answered = self.launcher.answered_at.get(job.id, {})
            answered_by = self.launcher.answered_by.get(job.id, {})
            if attempt != job.attempt:  # another leader's launch: beats since
                launched, answered, answered_by = self.since, {}, {}

            def settled(
                node: NodeInfo,
                launched: float = launched,
                answered: dict[str, float] = answered,
                by: dict[str, float] = answered_by,
                job: JobRecord = job,
            ) -> bool:
                """The node's newest beat lists the attempt's ranks: its agent built it
                after carrying out the launch (``reconcile.knows_launch``). An agent that
                does not say is judged by clocks: a beat sent after the node answered the
                launch (both on its own clock); without that stamp (another leader's
                launch, an agent that sends none) one that arrived a beat's interval after
                the launch was answered or this leader took over."""
                if node.id in silent:
                    return False
                knows = knows_launch(node, job.id, job.attempt, by.get(node.id, 0.0))
                if knows is not None:
                    return knows
                if answered.get(node.id):
                    return node.beat_sent_at > answered[node.id]
                return node.beat_seen > launched + node.interval_s

            for found in job_findings(job, nodes, settled, self._findings):
                if isinstance(found, Exited) and not self._exits_seen.lasted(
                    (job.id, job.attempt, found.report.rank), now, nodes[found.node].interval_s
                ):
                    continue  # the agent's own event may still be on its way
                event = _exit_event(job, found)
                log.warning("reconciled a rank's exit", job=job.id, message=event.message)
                await out.missed_exit(event)
        self._exits_seen.tick_done()
        for orphan in orphans(jobs, ranked, lambda n: n.id not in silent, self._orphans):
            report = orphan.report
            key = (orphan.node, report.job, report.attempt)
            if not self._orphans_seen.lasted(key, now, nodes[orphan.node].interval_s):
                continue
            if now - self._orphans_stopped.get(key, -1e18) < ORPHAN_RETRY_S:
                continue
            self._orphans_stopped[key] = now
            why = f"orphan: rank {report.rank} of attempt {report.attempt} that nothing expects"
            log.warning("stopping an orphan rank", node=orphan.node, job=report.job, why=why)
            out.stop_orphan(orphan.node, report, why)
        self._orphans_seen.tick_done()
        # forget orphans no longer reported, so the record stays as small as what is seen
        seen = self._orphans_seen.first
        self._orphans_stopped = {k: t for k, t in self._orphans_stopped.items() if k in seen}


def _exit_event(job: JobRecord, found: Exited | Missing) -> WorkerExited:
    if isinstance(found, Exited):
        r = found.report
        how = (
            f"code {r.exit_code}"
            if r.exit_code is not None
            else (f"signal {r.signal}" if r.signal else "an unknown code")
        )
        return WorkerExited(
            node=found.node,
            job=job.id,
            rank=r.rank,
            attempt=r.attempt,
            pid=r.pid,
            exit_code=r.exit_code,
            signal=r.signal,
            severity=Severity.INFO if r.exit_code == 0 else Severity.CRITICAL,
            message=f"rank {r.rank} exited with {how} (from {found.node}'s rank report)",
        )
    node, rank = found.node, found.rank
    return WorkerExited(
        node=node,
        job=job.id,
        rank=rank,
        attempt=job.attempt,
        severity=Severity.CRITICAL,
        message=f"rank {rank} is not running on {node}: its agent reports no such rank",
    )
