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

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from coordinator import (
    actions,
    exclusion,
    hang_verdict,
    job_machine,
    loop_support,
    policy,
    progress_policy,
)
from coordinator.cas import CasStore, Conflict
from coordinator.commander import CommandSender
from coordinator.goodput import account, charge_detection
from coordinator.job_api import OperatorInputs
from coordinator.job_events import EventInputs
from coordinator.job_machine import Effect, Input
from coordinator.job_progress import ProgressInputs
from coordinator.job_reconcile import Reconciler
from coordinator.jobstore import JobStore
from coordinator.launch import Launcher
from coordinator.loss_verdict import AwaitedVerdicts
from coordinator.recovery import Stopper, grow_reason
from coordinator.registry import Registry
from proto.commands import CheckpointNow, Pause, Resume, ResyncClock
from proto.conditions import Severity
from proto.events import (
    EventBase,
    JobCompleted,
    JobFailed,
    JobRecovering,
    JobStopped,
    JobUnheeded,
)
from proto.job import JobRecord, JobState
from proto.node import NodeState
from proto.progress import Reaction
from ringmaster.clock import SYSTEM, Clock

log = structlog.get_logger()
Publish = Callable[[EventBase], Awaitable[None]]
OVERDUE_S = 5.0  # clean exits without rank 0's final word: decided after this long
_END_INPUT = {
    JobState.COMPLETED: Input.COMPLETE,
    JobState.FAILED: Input.FAIL,
    JobState.STOPPED: Input.STOPPED,
}


class JobManager(OperatorInputs, EventInputs, ProgressInputs):
    def __init__(
        self,
        store: CasStore,
        commander: CommandSender,
        registry: Registry,
        publish: Publish,
        clock: Clock = SYSTEM,
    ) -> None:
        self.store = JobStore(store)
        self.cmd = commander
        self.registry = registry
        self.publish = publish
        self.clock = clock  # what every decision of the manager's (and its parts') reads
        self.jobs: dict[str, JobRecord] = {}
        self.launcher = Launcher(commander, registry, publish, self.save, clock)
        self.stopper = Stopper(commander, registry, clock)
        self.reconciler = Reconciler(self)
        self._stepped_at: dict[str, float] = {}  # monotonic time of each job's newest step
        self._straggled: dict[tuple[str, int], set[int]] = {}  # ranks reported per attempt
        self._slow_window: dict[tuple[str, int], set[int]] = {}  # ranks slow, last window
        self._checkpoint_began: dict[str, tuple[int, float]] = {}
        self._stamped: dict[str, tuple[int, float]] = {}
        self._dirty: set[str] = set()
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._exited_at: dict[tuple[str, int], float] = {}
        self._awaited = AwaitedVerdicts()

    # -- persistence ------------------------------------------------------------------

    async def load(self) -> None:
        """Take over every job from the store (a new leader continues where the last
        was): stops that were under way are started again (they are idempotent)."""
        self.jobs = await self.store.load()
        for job in self.jobs.values():
            if job.state is JobState.RECOVERING and job.stopping_attempt:
                self._stop_attempt(job, job.reason or "restart", graceful=job.stop_graceful)
            elif job.stopping and not job.state.terminal:
                self.spawn(job.id, "stop", self._stop_job(job.id, job.reason))

    async def save(self, job: JobRecord) -> None:
        """Compare-and-set; on a conflict the record another leader wrote replaces ours
        and the conflict propagates, so nothing acts on the stale transition."""
        job.updated_at = self.clock.time()
        try:
            await self.store.save(job)
        except Conflict:
            current = await self.store.read(job.id)
            if current is not None:
                self.jobs[job.id] = current
            raise
        self._dirty.discard(job.id)

    async def flush(self) -> None:
        for job_id in list(self._dirty):
            await self.save(self.jobs[job_id])

    def spawn(self, job: str, what: str, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task (one per job and kind), logging its failure."""

        async def logged() -> None:
            try:
                await work
            except Conflict:
                log.warning("another leader holds the job now", job=job, task=what)
            except Exception as exc:
                log.error("job task failed", job=job, task=what, error=repr(exc))

        self._tasks[(job, what)] = asyncio.create_task(logged(), name=f"{what}:{job}")

    def busy(self, job: str, what: str) -> bool:
        task = self._tasks.get((job, what))
        return task is not None and not task.done()

    def abandon(self) -> None:
        """Leadership lost: what this leader had under way is its successor's now."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    async def settle(self) -> None:
        """Wait for every task in flight (tests, and a leader stepping down)."""
        while pending := [t for t in self._tasks.values() if not t.done()]:
            await asyncio.gather(*pending, return_exceptions=True)

    # -- actions ----------------------------------------------------------------------

    async def apply(self, job: JobRecord | None, action: actions.Action) -> None:
        """Carry out one action; ``job`` is None for node actions outside any job."""
        log.info("policy action", job=job.id if job else None, action=repr(action))
        match action:
            case actions.DeclareLost(node=node, reason=reason):
                self.registry.declare_lost(node, reason)  # the leader's sweep says it
            case actions.DrainNode(node=node, key=key, reason=reason):
                self.registry.drain(node, key, reason)
            case actions.ResyncNode(node=node, reason=reason):
                await self._resync(node, reason)
        if job is None:
            return
        match action:
            case actions.PauseJob(reason=reason, reasons=reasons, send=send):
                job.pause_reasons = list(reasons)
                if send:
                    await self.save(job)  # the reasons are on record before rank 0 acts
                    await self._to_rank0(job, Pause(job=job.id, reason=reason))
            case actions.ResumeJob(reason=reason, reasons=reasons, send=send):
                job.pause_reasons = list(reasons)
                if send:
                    await self.save(job)
                    await self._to_rank0(job, Resume(job=job.id, reason=reason))
            case actions.CheckpointJob(reason=reason):
                await self._checkpoint(job, reason)
            case actions.RestartJob():
                await self._restart(job, action)
            case actions.ReportStraggler():
                await self._straggler(job, action)
            case actions.RefuseNode(node=node, reason=reason):
                await self.launcher.explain(job, {node: reason})
            case actions.FinishJob(state=state, reason=reason, requeue=requeue):
                job.requeue = job.requeue or requeue  # a stop's own end keeps its word
                await self.finish(job, state, reason)
            case actions.Unheeded(key=key, opened=False):
                job.unheeded = [k for k in job.unheeded if k != key]
            case actions.Unheeded(key=key, reaction=reaction, reason=reason, why=why):
                job.unheeded = [*job.unheeded, key]
                await self.publish(
                    JobUnheeded(
                        job=job.id,
                        severity=Severity.WARNING,
                        condition_key=key,
                        reaction=reaction,
                        reason=reason,
                        message=f"{reason}: not {reaction}d, it trains on; {why}",
                    )
                )
        self._dirty.add(job.id)

    async def _restart(self, job: JobRecord, action: actions.RestartJob) -> None:
        """Give the attempt up: count a failure against the budget (failing the job when
        it repeats), leave out what the policy names, then stop the attempt as a task."""
        if job.state not in job_machine.LIVE or job.stopping:
            return
        now = self.clock.time()
        if action.failure is not None:
            if (spent := job_machine.charge(job, action.failure, action.exclude)) is not None:
                await self.finish(job, JobState.FAILED, f"{action.reason}; {spent}")
                return
            job.restarts += 1
        for node in action.exclude:
            started = (
                self.registry.nodes[node].agent_started_at if node in self.registry.nodes else 0.0
            )
            exclusion.leave_out(job, node, action.reason, now, started)
        charge_detection(job, now)
        job.failed_at_step, job.reason, job.stop_graceful = job.step, action.reason, action.graceful
        job_machine.fire(job, Input.FAULT)
        await self.save(job)
        await self.publish(
            JobRecovering(
                job=job.id,
                severity=Severity.WARNING,
                reason=action.reason,
                restarts=job.restarts,
                message=action.reason
                + (" (checkpointing at the next step first)" if action.graceful else ""),
            )
        )
        self._stop_attempt(job, action.reason, action.graceful)

    def _stop_attempt(self, job: JobRecord, reason: str, graceful: bool) -> None:
        job_id, nodes, attempt = job.id, list(job.nodes), job.stopping_attempt

        async def stop() -> None:
            await self.stopper.stop_attempt(job_id, nodes, attempt, reason, graceful)
            current = self.jobs.get(job_id)
            if current is not None and current.stopping_attempt == attempt:
                job_machine.fire(current, Input.ATTEMPT_STOPPED)
                await self.save(current)

        self.spawn(job_id, "stop-attempt", stop())

    async def _resync(self, node: str, reason: str) -> None:
        """The agent steps its clock and reports ``clock.resynced`` with the offsets."""
        log.info("resyncing clock", node=node, reason=reason)
        reply = await self.cmd.send(node, ResyncClock(), timeout=60)
        if not reply.ok:
            log.warning("clock resync failed", node=node, error=reply.error)

    async def _checkpoint(self, job: JobRecord, reason: str) -> None:
        if loop_support.lacking(job, Reaction.CHECKPOINT) is not None:
            return  # its loop would never say it checkpointed: no state to wait in
        if await self._to_rank0(job, CheckpointNow(job=job.id, reason=reason)):
            job_machine.fire(job, Input.CHECKPOINT)

    async def _to_rank0(self, job: JobRecord, cmd: Pause | Resume | CheckpointNow) -> bool:
        if not job.nodes or job.state not in job_machine.LIVE:
            return False
        reply = await self.cmd.send(job.nodes[0], cmd)
        if not reply.ok:
            log.warning("command failed", job=job.id, node=job.nodes[0], error=reply.error)
        return reply.ok

    async def _stop(self, job: JobRecord, reason: str) -> None:
        job.reason = reason
        row = job_machine.fire(job, Input.STOP)
        if row is None:
            return
        if Effect.STOP_JOB not in row.effects:
            await self._ended(job, row, reason)
            return
        await self.save(job)
        self.spawn(job.id, "stop", self._stop_job(job.id, reason))

    async def _stop_job(self, job_id: str, reason: str) -> None:
        job = self.jobs[job_id]
        at_boundary = loop_support.lacking(job, Reaction.PAUSE) is None
        silent = await self.stopper.stop_job(job_id, list(job.nodes), reason, at_boundary)
        job = self.jobs.get(job_id, job)
        if not job.state.terminal:
            why = reason + (f"; {', '.join(silent)} did not confirm the stop" if silent else "")
            await self.finish(job, JobState.STOPPED, why)

    async def finish(self, job: JobRecord, state: JobState, reason: str) -> None:
        job.reason = reason
        row = job_machine.fire(job, _END_INPUT[state])
        if row is not None:
            await self._ended(job, row, reason)

    async def _ended(self, job: JobRecord, row: job_machine.Row, reason: str) -> None:
        job.finished_at = self.clock.time()
        await self.save(job)
        if Effect.KILL_RANKS in row.effects and job.nodes:
            self.spawn(job.id, "kill", self.stopper.kill(job.id, list(job.nodes), reason))
        event: EventBase
        if job.state is JobState.COMPLETED:
            event = JobCompleted(job=job.id, step=job.step, message=reason)
        elif job.state is JobState.STOPPED:
            event = JobStopped(job=job.id, step=job.step, reason=reason, message=reason)
        else:
            event = JobFailed(job=job.id, severity=Severity.CRITICAL, reason=reason, message=reason)
        await self.publish(event)

    # -- periodic ---------------------------------------------------------------------

    async def tick(self) -> None:
        now = self.clock.time()
        await self.reconciler.reconcile()
        self.vouch_for_away_nodes()
        for job, away in self._awaited.ready(self.jobs, self.clock.monotonic(), self._decidable):
            node = self.registry.nodes.get(away.node or "")
            if node is not None and node.state is NodeState.AWAY:  # not beating again since
                await self._decide(job, away)
        for job, hung in hang_verdict.ready(self.jobs, now, self._network_evidence):
            await self._decide(job, hung)
        for job in list(self.jobs.values()):
            if job.state.terminal:
                continue
            account(job, now)
            self._dirty.add(job.id)
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
            exited = self._exited_at.get((job.id, job.attempt))
            if exited is not None and self.clock.monotonic() - exited > OVERDUE_S:
                for action in progress_policy.overdue(job):
                    await self.apply(job, action)
        await self.flush()

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
