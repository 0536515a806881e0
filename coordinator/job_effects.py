"""Carrying out what was decided about a job: the policy's actions, the state machine's
effects, and the events the inputs' handlers have to say.

The handlers (:mod:`coordinator.job_events`, :mod:`coordinator.job_progress`, the operator's
:mod:`coordinator.job_api`) decide and return; the job manager hands what they returned
here, in order. Every change of state is a row of :mod:`coordinator.job_machine`, saved
(compare-and-set, through :class:`coordinator.job_table.JobTable`) before the commands
that act on it are sent, so a deposed leader's late transition fails at the store instead
of reaching the nodes. Stops and kills run as the table's tasks
(:mod:`coordinator.recovery`), whose end is the state machine's next input.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import structlog

from coordinator import actions, exclusion, job_machine, loop_support
from coordinator.commander import CommandSender
from coordinator.goodput import charge_detection
from coordinator.job_machine import Effect, Input
from coordinator.job_table import JobTable
from coordinator.launch import Launcher
from coordinator.recovery import Stopper
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
    WorkerStraggler,
)
from proto.job import JobRecord, JobState
from proto.progress import Reaction
from ringmaster.clock import Clock

log = structlog.get_logger()
Publish = Callable[[EventBase], Awaitable[None]]
# what a handler returns about a job: actions to carry out and events to publish, in order
Outcome = actions.Action | EventBase
_END_INPUT = {
    JobState.COMPLETED: Input.COMPLETE,
    JobState.FAILED: Input.FAIL,
    JobState.STOPPED: Input.STOPPED,
}


class JobEffects:
    def __init__(
        self,
        table: JobTable,
        cmd: CommandSender,
        registry: Registry,
        publish: Publish,
        launcher: Launcher,
        stopper: Stopper,
        clock: Clock,
    ) -> None:
        self.table, self.cmd, self.registry, self.publish = table, cmd, registry, publish
        self.launcher, self.stopper, self.clock = launcher, stopper, clock

    async def carry_out(self, job: JobRecord, outcomes: Iterable[Outcome]) -> None:
        """What a handler returned about ``job``, in its order."""
        for outcome in outcomes:
            if isinstance(outcome, EventBase):
                await self.publish(outcome)
            else:
                await self.apply(job, outcome)

    def take_up(self, job: JobRecord) -> None:
        """A record read from the store: a stop that was under way is started again (a
        stop is idempotent), its end the state machine's input as before."""
        if job.state is JobState.RECOVERING and job.stopping_attempt:
            self._stop_attempt(job, job.reason or "restart", graceful=job.stop_graceful)
        elif job.stopping and not job.state.terminal:
            self.table.spawn(job.id, "stop", self._stop_job(job.id, job.reason))

    async def apply(self, job: JobRecord | None, action: actions.Action) -> None:
        """Carry out one action; ``job`` is None for node actions outside any job."""
        log.info("policy action", job=job.id if job else None, action=repr(action))
        match action:
            case actions.DeclareLost(node=node, reason=reason):
                self.registry.declare_lost(node, reason)  # the leader's sweep says it
            case actions.DrainNode(node=node, key=key, reason=reason):
                self.registry.drain(node, key, reason)
            case actions.HoldNode(node=node, evidence=evidence):
                self.registry.hold(node, evidence)
            case actions.ResyncNode(node=node, reason=reason):
                await self._resync(node, reason)
        if job is None:
            return
        match action:
            case actions.PauseJob(reason=reason, reasons=reasons, send=send):
                job.pause_reasons = list(reasons)
                if send:
                    await self.table.save(job)  # the reasons are on record before rank 0 acts
                    await self._to_rank0(job, Pause(job=job.id, reason=reason))
            case actions.ResumeJob(reason=reason, reasons=reasons, send=send):
                job.pause_reasons = list(reasons)
                if send:
                    await self.table.save(job)
                    await self._to_rank0(job, Resume(job=job.id, reason=reason))
            case actions.CheckpointJob(reason=reason):
                await self.checkpoint(job, reason)
            case actions.RestartJob():
                await self._restart(job, action)
            case actions.ReportStraggler():
                await self._straggler(job, action)
            case actions.RefuseNode(node=node, reason=reason):
                await self.launcher.explain(job, {node: reason})
            case actions.FinishJob(state=state, reason=reason, requeue=requeue):
                job.requeue = job.requeue or requeue  # a stop's own end keeps its word
                await self._finish(job, state, reason)
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
        self.table.changed(job)

    async def _restart(self, job: JobRecord, action: actions.RestartJob) -> None:
        """Give the attempt up: count a failure against the budget (failing the job when
        it repeats), leave out what the policy names, then stop the attempt as a task."""
        if job.state not in job_machine.LIVE or job.stopping:
            return
        now = self.clock.time()
        if action.failure is not None:
            if (spent := job_machine.charge(job, action.failure, action.exclude)) is not None:
                await self._finish(job, JobState.FAILED, f"{action.reason}; {spent}")
                return
            job.restarts += 1
        for node in action.exclude:
            exclusion.leave_out(job, node, action.reason, now, self.registry.nodes.get(node))
        charge_detection(job, now)
        job.failed_at_step, job.reason, job.stop_graceful = job.step, action.reason, action.graceful
        job_machine.fire(job, Input.FAULT)
        await self.table.save(job)
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
            current = self.table.jobs.get(job_id)
            if current is not None and current.stopping_attempt == attempt:
                job_machine.fire(current, Input.ATTEMPT_STOPPED)
                await self.table.save(current)

        self.table.spawn(job_id, "stop-attempt", stop())

    async def _resync(self, node: str, reason: str) -> None:
        """The agent steps its clock and reports ``clock.resynced`` with the offsets."""
        log.info("resyncing clock", node=node, reason=reason)
        reply = await self.cmd.send(node, ResyncClock(), timeout=60)
        if not reply.ok:
            log.warning("clock resync failed", node=node, error=reply.error)

    async def checkpoint(self, job: JobRecord, reason: str) -> None:
        """Ask rank 0 for a checkpoint; the job is checkpointing once it accepted."""
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

    async def stop(self, job: JobRecord, reason: str) -> None:
        """The operator's stop: of a live attempt, as a task whose end stops the job; of
        a pending or recovering job, at once."""
        job.reason = reason
        row = job_machine.fire(job, Input.STOP)
        if row is None:
            return
        if Effect.STOP_JOB not in row.effects:
            await self._ended(job, row, reason)
            return
        await self.table.save(job)
        self.table.spawn(job.id, "stop", self._stop_job(job.id, reason))

    async def _stop_job(self, job_id: str, reason: str) -> None:
        job = self.table.jobs[job_id]
        at_boundary = loop_support.lacking(job, Reaction.PAUSE) is None
        silent = await self.stopper.stop_job(job_id, list(job.nodes), reason, at_boundary)
        job = self.table.jobs.get(job_id, job)
        if not job.state.terminal:
            why = reason + (f"; {', '.join(silent)} did not confirm the stop" if silent else "")
            await self._finish(job, JobState.STOPPED, why)

    async def _finish(self, job: JobRecord, state: JobState, reason: str) -> None:
        job.reason = reason
        row = job_machine.fire(job, _END_INPUT[state])
        if row is not None:
            await self._ended(job, row, reason)

    async def _ended(self, job: JobRecord, row: job_machine.Row, reason: str) -> None:
        job.finished_at = self.clock.time()
        await self.table.save(job)
        if Effect.KILL_RANKS in row.effects and job.nodes:
            kill = self.stopper.kill(job.id, list(job.nodes), reason)
            self.table.spawn(job.id, "kill", kill)
        event: EventBase
        if job.state is JobState.COMPLETED:
            event = JobCompleted(job=job.id, step=job.step, message=reason)
        elif job.state is JobState.STOPPED:
            event = JobStopped(job=job.id, step=job.step, reason=reason, message=reason)
        else:
            event = JobFailed(job=job.id, severity=Severity.CRITICAL, reason=reason, message=reason)
        await self.publish(event)

    async def _straggler(self, job: JobRecord, found: actions.ReportStraggler) -> None:
        """Said once per attempt (the attempt's books remember it was)."""
        self.table.books(job.id).attempt(job.attempt).straggled.add(found.rank)
        ratio = found.step_s / found.peer_median_s
        await self.publish(
            WorkerStraggler(
                job=job.id,
                node=found.node,
                severity=Severity.WARNING,
                rank=found.rank,
                attempt=job.attempt,
                step=job.step,
                step_s=found.step_s,
                peer_median_s=found.peer_median_s,
                ratio=ratio,
                window_steps=job.spec.policy.straggler_window_steps,
                message=f"rank {found.rank} on {found.node}: {found.step_s:.3f} s per step, "
                f"{ratio:.1f}× its peers' median {found.peer_median_s:.3f} s",
            )
        )
