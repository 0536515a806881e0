"""The job lifecycle's I/O shell: inputs in, the state machine and the policy decide,
actions out.

Every change of a job's state is a row of :mod:`coordinator.job_machine`; every reaction
to a fault is the policy's (:mod:`coordinator.policy`). This module feeds them what
happened — the operator's requests (:mod:`coordinator.job_api`), agents' events
(:mod:`coordinator.job_events`), rank 0's progress (:mod:`coordinator.job_progress`), the
nodes' own rank reports reconciled each tick (:mod:`coordinator.reconcile`) — keeps the
records (compare-and-set, :mod:`coordinator.jobstore`) and carries out what they return. A change
of state is saved before the commands that act on it are sent, so a deposed leader's late
transition fails at the store instead of reaching the nodes. Stops and launches run as
tasks (:mod:`coordinator.recovery`, :mod:`coordinator.launch`) whose end is an input.

Time is an input too: the manager and everything it builds (launcher, stopper,
reconciler) read the one :class:`~ringmaster.clock.Clock` it is given and hand ``now`` to
the pure modules, so a test's manual clock drives every decision at once.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from coordinator import (
    actions,
    exclusion,
    hang_verdict,
    job_progress,
    policy,
    progress_policy,
)
from coordinator.cas import CasStore
from coordinator.commander import CommandSender
from coordinator.goodput import account
from coordinator.job_api import OperatorInputs
from coordinator.job_effects import JobEffects
from coordinator.job_events import AgentEvents
from coordinator.job_reconcile import Reconciler
from coordinator.job_table import JobTable
from coordinator.launch import Launcher
from coordinator.recovery import Stopper, grow_reason
from coordinator.registry import Registry
from proto.events import (
    EventBase,
    NodeAway,
    WorkerExited,
)
from proto.job import JobRecord, JobState
from proto.node import RankReport
from proto.progress import Progress
from ringmaster.clock import SYSTEM, Clock

log = structlog.get_logger()
Publish = Callable[[EventBase], Awaitable[None]]
OVERDUE_S = 5.0  # clean exits without rank 0's final word: decided after this long


class JobManager(OperatorInputs):
    def __init__(
        self,
        store: CasStore,
        commander: CommandSender,
        registry: Registry,
        publish: Publish,
        clock: Clock = SYSTEM,
    ) -> None:
        self.table = JobTable(store, clock)
        self.jobs = self.table.jobs
        self.cmd = commander
        self.registry = registry
        self.publish = publish
        self.clock = clock  # what every decision of the manager's (and its parts') reads
        self.launcher = Launcher(commander, registry, publish, self.table.save, clock)
        self.stopper = Stopper(commander, registry, clock)
        self.reconciler = Reconciler(registry, self.launcher, clock)
        self.effects = JobEffects(
            self.table, commander, registry, publish, self.launcher, self.stopper, clock
        )
        self.events = AgentEvents(registry, self.stopper.unreachable, clock)

    # -- persistence ------------------------------------------------------------------

    async def load(self) -> None:
        """Take over every job from the store (a new leader continues where the last
        was): stops that were under way are started again (they are idempotent)."""
        await self.table.load()
        for job in self.jobs.values():
            self.effects.take_up(job)

    async def save(self, job: JobRecord) -> None:
        await self.table.save(job)

    async def flush(self) -> None:
        await self.table.flush()

    def spawn(self, job: str, what: str, work: Coroutine[Any, Any, None]) -> None:
        self.table.spawn(job, what, work)

    def busy(self, job: str, what: str) -> bool:
        return self.table.busy(job, what)

    def abandon(self) -> None:
        self.table.abandon()

    async def settle(self) -> None:
        await self.table.settle()

    # -- actions ----------------------------------------------------------------------

    async def apply(self, job: JobRecord | None, action: actions.Action) -> None:
        await self.effects.apply(job, action)

    async def _checkpoint(self, job: JobRecord, reason: str) -> None:
        await self.effects.checkpoint(job, reason)

    async def _stop(self, job: JobRecord, reason: str) -> None:
        await self.effects.stop(job, reason)

    # -- periodic ---------------------------------------------------------------------

    async def tick(self) -> None:
        now = self.clock.time()
        await self.reconciler.reconcile(self.jobs, self)
        mono = self.clock.monotonic()
        for job in self.jobs.values():
            self.events.vouch_for_away_nodes(job, self.table.books(job.id), mono)
        for job, away in self.table.awaited.ready(self.jobs, mono, self._decidable):
            if self.events.still_away(away):  # not beating again since
                await self._decide(job, away)
        for job, hung in hang_verdict.ready(self.jobs, now, self.events.network_evidence):
            await self._decide(job, hung)
        for job in list(self.jobs.values()):
            if job.state.terminal:
                continue
            account(job, now)
            self.table.changed(job)
            if job.state in (JobState.PENDING, JobState.RECOVERING):
                if job.stopping_attempt or job.stopping:
                    continue  # its last attempt is still stopping
                for action in policy.waited_too_long(job, now):
                    await self.apply(job, action)
                if not job.state.terminal and not self.busy(job.id, "launch"):
                    self.spawn(job.id, "launch", self.start_pending(job))
            elif stall := progress_policy.on_network_stall(
                job, self.registry.link_conditions(job.nodes), now
            ):
                for action in stall:
                    await self.apply(job, action)
            elif why := grow_reason(job, functools.partial(self._free, job), now):
                await self.apply(job, actions.RestartJob(why, graceful=True))
            elif self._bounding_due(job, now):
                job.bounding_checkpoint_at = now
                await self._checkpoint(job, "bounding what a preemption notice can cost")
            exited = self.table.books(job.id).attempt(job.attempt).first_exit_at
            if exited is not None and self.clock.monotonic() - exited > OVERDUE_S:
                for action in progress_policy.overdue(job):
                    await self.apply(job, action)
        await self.flush()

    async def on_event(self, event: EventBase) -> None:
        """One agent's event, its ``node`` already checked against the subject it came on
        (the leader does that): what it asks of its node, then of each job in turn."""
        for action in self.events.on_nodes(event):
            await self.effects.apply(None, action)
        for job in list(self.jobs.values()):
            books = self.table.books(job.id)
            outcomes = await self.events.take(job, books, self.table.awaited, event)
            await self.effects.carry_out(job, outcomes)

    async def _decide(self, job: JobRecord, event: EventBase) -> None:
        """A verdict that waited for its evidence, given now."""
        decided = await self.events.decide(job, self.table.books(job.id), event)
        await self.effects.carry_out(job, decided)

    def _decidable(self, job: JobRecord, event: NodeAway, due: float) -> bool:
        return self.events.decidable(job, self.table.books(job.id), event, due)

    async def missed_exit(self, event: WorkerExited) -> None:
        """An exit reconciliation found: published, then taken as the agent's own."""
        await self.publish(event)
        await self.on_event(event)

    def stop_orphan(self, node: str, report: RankReport, why: str) -> None:
        kill = self.stopper.kill(report.job, [node], why, attempt=report.attempt)
        self.spawn(report.job, f"orphan:{node}", kill)

    async def on_progress(self, msg: Progress, sender: str) -> None:
        """Rank 0's word, from ``sender`` (the node its subject names)."""
        job = self.jobs.get(msg.job)
        if job is not None and not job.state.terminal:
            books = self.table.books(job.id)
            await self.effects.carry_out(
                job, job_progress.take(job, books, msg, sender, self.clock)
            )

    async def start_pending(self, job: JobRecord) -> None:
        """One try at starting the job's next attempt. A relaunch re-applies the pause
        reasons that still hold."""
        if await self.launcher.start(job, self._busy(job)):
            for action in policy.relaunched(job, self.registry.active(job.nodes)):
                await self.apply(job, action)

    @staticmethod
    def _bounding_due(job: JobRecord, now: float) -> bool:
        """A checkpoint is due to bound what a preemption notice can cost the job."""
        every = policy.bounded_cadence(job)
        last = job.bounding_checkpoint_at or 0.0
        return every is not None and job.state is JobState.RUNNING and now - last >= every

    def _busy(self, job: JobRecord) -> set[str]:
        """Nodes other live jobs run on or hold as spares."""
        return {
            n
            for j in self.jobs.values()
            if j.id != job.id and not j.state.terminal
            for n in (*j.nodes, *j.spare_nodes)
        }

    def _free(self, job: JobRecord) -> list[str]:
        """Healthy nodes ``job`` could grow onto: its spares first, then unused ones."""
        left_out = exclusion.left_out(job, self.registry.nodes, self.clock.time())
        busy, now = self._busy(job) | set(job.nodes) | set(left_out), self.clock.monotonic()
        silent = self.registry.silent(list(self.registry.nodes), now)
        free = [
            i
            for i, n in self.registry.nodes.items()
            if n.healthy and i not in busy and i not in silent
        ]
        return sorted(free, key=lambda i: (i not in job.spare_nodes, i))
