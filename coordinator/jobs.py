"""The job lifecycle's I/O shell: inputs in, the state machine and the policy decide,
actions out.

Every change of a job's state is a row of :mod:`coordinator.job_machine`; every reaction
to a fault is the policy's (:mod:`coordinator.policy`). The manager holds the jobs (their
records and books: :class:`coordinator.job_table.JobTable`) and hands each input to its
handler with the job's record and books: the operator's requests
(:mod:`coordinator.job_api`), agents' events (:mod:`coordinator.job_events`), rank 0's
progress (:mod:`coordinator.job_progress`), the nodes' own rank reports reconciled each
tick (:mod:`coordinator.job_reconcile`). A handler changes the record, returns what to say
and do, and the manager hands that to :class:`coordinator.job_effects.JobEffects`, which
saves each change of state before the commands that act on it are sent, so a deposed
leader's late transition fails at the store instead of reaching the nodes. Stops and
launches run as tasks (:mod:`coordinator.recovery`, :mod:`coordinator.launch`) whose end
is an input.

Time is an input too: the manager and everything it builds read the one
:class:`~ringmaster.clock.Clock` it is given and hand ``now`` to the pure modules, so a
test's manual clock drives every decision at once.
"""

from __future__ import annotations

import functools

from coordinator import (
    actions,
    exclusion,
    hang_verdict,
    job_api,
    job_progress,
    placement_policy,
    policy,
    progress_policy,
)
from coordinator.cas import CasStore
from coordinator.commander import CommandSender
from coordinator.goodput import account
from coordinator.job_effects import JobEffects, Publish
from coordinator.job_events import AgentEvents
from coordinator.job_reconcile import Reconciler
from coordinator.job_table import JobTable
from coordinator.launch import Launcher
from coordinator.recovery import Stopper, grow_reason
from coordinator.registry import Registry
from proto.api import ApiReply, JobControl, SubmitJob
from proto.events import EventBase, NodeAway, WorkerExited
from proto.job import JobRecord, JobState
from proto.node import RankReport
from proto.progress import Progress
from ringmaster.clock import SYSTEM, Clock

OVERDUE_S = 5.0  # clean exits without rank 0's final word: decided after this long


class JobManager:
    def __init__(
        self,
        store: CasStore,
        commander: CommandSender,
        registry: Registry,
        publish: Publish,
        clock: Clock = SYSTEM,
    ) -> None:
        self.table = JobTable(store, clock)
        self.jobs = self.table.jobs  # the records (the table's own map, never another)
        self.registry, self.publish = registry, publish
        self.clock = clock  # what every decision of the manager's (and its parts') reads
        self.launcher = Launcher(commander, registry, publish, self.table.save, clock)
        self.stopper = Stopper(commander, registry, clock)
        self.reconciler = Reconciler(registry, self.launcher, clock)
        self.events = AgentEvents(registry, self.stopper.unreachable, clock)
        self.effects = JobEffects(
            self.table, commander, registry, publish, self.launcher, self.stopper, clock
        )

    async def load(self) -> None:
        """Take over every job from the store (a new leader continues where the last
        was): stops that were under way are started again (they are idempotent)."""
        await self.table.load()
        for job in self.jobs.values():
            self.effects.take_up(job)

    async def flush(self) -> None:
        await self.table.flush()

    def abandon(self) -> None:
        self.table.abandon()

    async def settle(self) -> None:
        await self.table.settle()

    # -- inputs -----------------------------------------------------------------------

    async def submit(self, req: SubmitJob) -> ApiReply:
        job, said = job_api.submitted(req, self.clock.time())
        self.jobs[job.id] = job
        await self.table.save(job)
        await self.publish(said)
        return ApiReply(ok=True, job=job.id)

    async def control(self, req: JobControl) -> ApiReply:
        return await job_api.control(self.jobs.get(req.job), req, self.effects, self.clock.time())

    async def on_event(self, event: EventBase) -> None:
        """One agent's event, its ``node`` already checked against the subject it came on
        (the leader does that): what it asks of its node, then of each job in turn."""
        for action in self.events.on_nodes(event):
            await self.effects.apply(None, action)
        for job in list(self.jobs.values()):
            books = self.table.books(job.id)
            outcomes = await self.events.take(job, books, self.table.awaited, event)
            await self.effects.carry_out(job, outcomes)

    async def operator_drained(self, node: str, why: str) -> None:
        """An operator drained ``node``: every live job with ranks there moves off it."""
        for job in list(self.jobs.values()):
            await self.effects.carry_out(job, policy.on_operator_drain(job, node, why))

    async def on_progress(self, msg: Progress, sender: str) -> None:
        """Rank 0's word, from ``sender`` (the node its subject names)."""
        job = self.jobs.get(msg.job)
        if job is not None and not job.state.terminal:
            outcomes = job_progress.take(job, self.table.books(job.id), msg, sender, self.clock)
            await self.effects.carry_out(job, outcomes)

    async def missed_exit(self, event: WorkerExited) -> None:
        """An exit reconciliation found: published, then taken as the agent's own."""
        await self.publish(event)
        await self.on_event(event)

    def stop_orphan(self, node: str, report: RankReport, why: str) -> None:
        kill = self.stopper.kill(report.job, [node], why, attempt=report.attempt)
        self.table.spawn(report.job, f"orphan:{node}", kill)

    # -- periodic ---------------------------------------------------------------------

    async def tick(self) -> None:
        """Reconciliation, the verdicts whose wait is over, then each live job's clocks;
        every change not yet saved is saved at the end."""
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
            if not job.state.terminal:
                await self._time_passed(job, now)
        await self.table.flush()

    async def _time_passed(self, job: JobRecord, now: float) -> None:
        account(job, now)
        self.table.changed(job)
        if job.state in (JobState.PENDING, JobState.RECOVERING):
            if job.stopping_attempt or job.stopping:
                return  # its last attempt is still stopping
            for action in placement_policy.waited_too_long(job, now):
                await self.effects.apply(job, action)
            if not job.state.terminal and not self.table.busy(job.id, "launch"):
                self.table.spawn(job.id, "launch", self.start_pending(job))
        elif stall := progress_policy.on_network_stall(
            job, self.registry.link_conditions(job.nodes), now
        ):
            await self.effects.carry_out(job, stall)
        elif why := grow_reason(job, functools.partial(self._free, job), now):
            await self.effects.apply(job, actions.RestartJob(why, graceful=True))
        elif self._bounding_due(job, now):
            job.bounding_checkpoint_at = now
            await self.effects.checkpoint(job, "bounding what a preemption notice can cost")
        exited = self.table.books(job.id).attempt(job.attempt).first_exit_at
        if exited is not None and self.clock.monotonic() - exited > OVERDUE_S:
            await self.effects.carry_out(job, progress_policy.overdue(job))

    async def _decide(self, job: JobRecord, event: EventBase) -> None:
        """A verdict that waited for its evidence, given now."""
        decided = await self.events.decide(job, self.table.books(job.id), event)
        await self.effects.carry_out(job, decided)

    def _decidable(self, job: JobRecord, event: NodeAway, due: float) -> bool:
        return self.events.decidable(job, self.table.books(job.id), event, due)

    async def start_pending(self, job: JobRecord) -> None:
        """One try at starting the job's next attempt. A relaunch re-applies the pause
        reasons that still hold."""
        if await self.launcher.start(job, self._busy(job)):
            relaunched = policy.relaunched(job, self.registry.active(job.nodes))
            await self.effects.carry_out(job, relaunched)

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
