"""The job lifecycle: the I/O shell around admission, rendezvous and policy.

Records live in JetStream KV and are written by compare-and-set on their revision, so a
deposed leader cannot overwrite its successor's state. The state machine is documented on
:class:`proto.job.JobState`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog
from nats.js.errors import KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from coordinator import policy
from coordinator.commander import Commander
from coordinator.goodput import account, charge_lost_work, move_stall
from coordinator.registry import Registry
from coordinator.rendezvous import admit, plan
from proto.api import ApiReply, JobControl, SubmitJob
from proto.codec import encode, job_decoder
from proto.commands import CheckpointNow, Launch, Pause, ReservePort, Resume, ResyncClock, Stop
from proto.events import (
    EventBase,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobPaused,
    JobRecovering,
    JobRestarted,
    JobResumed,
    JobStarted,
    JobStopped,
    JobSubmitted,
    NodeRefused,
    Severity,
    WorkerExited,
)
from proto.job import JobRecord, JobState
from proto.progress import Checkpointed, Finished, Paused, Progress, Resumed, StepDone

log = structlog.get_logger()
Publish = Callable[[EventBase], Awaitable[None]]
OPERATOR = "operator"


class JobManager:
    def __init__(
        self, kv: KeyValue, commander: Commander, registry: Registry, publish: Publish
    ) -> None:
        self.kv = kv
        self.cmd = commander
        self.registry = registry
        self.publish = publish
        self.jobs: dict[str, JobRecord] = {}
        self._revs: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._exited_at: dict[str, float] = {}
        self._waiting_logged: dict[str, str] = {}
        self._refusals: dict[str, dict[str, str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # -- persistence ------------------------------------------------------------------

    async def load(self) -> None:
        """Take over every job from KV (a new leader continues where the last one was)."""
        self.jobs.clear()
        self._revs.clear()
        with contextlib.suppress(NoKeysError):
            for key in await self.kv.keys():
                entry = await self.kv.get(key)
                if entry.value and entry.revision is not None:
                    self.jobs[key] = job_decoder.decode(entry.value)
                    self._revs[key] = entry.revision

    async def save(self, job: JobRecord) -> None:
        """Compare-and-set on the record's revision. Saves of one job are serialised: the
        ticker, a launch and progress may all save the same job at once."""
        async with self._locks.setdefault(job.id, asyncio.Lock()):
            job.updated_at = time.time()
            data = encode(job)
            try:
                if job.id in self._revs:
                    last = self._revs[job.id]
                    self._revs[job.id] = await self.kv.update(job.id, data, last=last)
                else:
                    self._revs[job.id] = await self.kv.create(job.id, data)
                self._dirty.discard(job.id)
            except KeyWrongLastSequenceError:
                log.error("job record changed under us; another leader?", job=job.id)
                raise

    async def flush(self) -> None:
        for job_id in list(self._dirty):
            await self.save(self.jobs[job_id])

    # -- operator API -----------------------------------------------------------------

    async def submit(self, req: SubmitJob) -> ApiReply:
        spec = req.spec
        job_id = f"{spec.job.name}-{secrets.token_hex(3)}"
        ckpt = Path(spec.checkpoint.dir)
        if not ckpt.is_absolute():
            spec.checkpoint.dir = str(Path(req.workdir or ".") / ckpt)
        job = JobRecord(
            id=job_id,
            name=spec.job.name,
            spec=spec,
            workdir=req.workdir,
            target_steps=spec.train.steps,
            submitted_at=time.time(),
        )
        self.jobs[job_id] = job
        await self.save(job)
        await self.publish(
            JobSubmitted(
                job=job_id,
                name=spec.job.name,
                nodes=spec.job.nodes,
                gpus_per_node=spec.job.gpus_per_node,
                message=f"submitted from {req.source or 'api'}",
            )
        )
        return ApiReply(ok=True, job=job_id)

    async def control(self, req: JobControl) -> ApiReply:
        job = self.jobs.get(req.job)
        if job is None:
            return ApiReply(ok=False, error=f"no job {req.job!r}")
        if job.state.terminal:
            return ApiReply(ok=False, error=f"job {job.id} is already {job.state.value}")
        match req.action:
            case "pause":
                await self._pause(job, OPERATOR, "operator request")
            case "resume":
                job.pause_reasons = []
                await self._to_rank0(job, Resume(job=job.id, reason="operator request"))
            case "checkpoint":
                await self._checkpoint(job, "operator request")
            case "stop":
                await self._stop(job, "stop requested by operator")
        await self.save(job)
        return ApiReply(ok=True, job=job.id)

    # -- inputs -----------------------------------------------------------------------

    async def on_event(self, event: EventBase) -> None:
        for job in list(self.jobs.values()):
            if isinstance(event, WorkerExited) and event.job == job.id:
                if event.attempt != job.attempt:
                    continue
                job.exited_ranks[str(event.rank)] = (
                    event.exit_code if event.exit_code is not None else -(event.signal or 0)
                )
                self._exited_at.setdefault(job.id, time.monotonic())
                self._dirty.add(job.id)
            for action in policy.decide(job, event):
                await self.apply(job, action)

    async def on_node_event(self, event: EventBase) -> None:
        for action in policy.decide_node(event):
            if isinstance(action, policy.ResyncNode):
                await self._resync(action.node, action.reason)

    async def _resync(self, node: str, reason: str) -> None:
        """The agent steps its clock and reports ``clock.resynced`` with the offsets."""
        log.info("resyncing clock", node=node, reason=reason)
        reply = await self.cmd.send(node, ResyncClock(), timeout=60)
        if not reply.ok:
            log.warning("clock resync failed", node=node, error=reply.error)

    async def on_progress(self, msg: Progress) -> None:
        job = self.jobs.get(msg.job)
        if job is None or job.state.terminal:
            return
        self._dirty.add(job.id)
        match msg:
            case StepDone(step=step, loss=loss):
                if job.state is JobState.STARTING:
                    job.state = JobState.RUNNING
                    job.first_step_at = job.first_step_at or time.time()
                    if job.restarts:
                        charge_lost_work(job, step - 1)
                job.step, job.loss = step, loss
            case Paused(step=step):
                job.state, job.step = JobState.PAUSED, max(job.step, step)
                job.pauses += 1
                why = ", ".join(job.pause_reasons) or OPERATOR
                await self.publish(JobPaused(job=job.id, step=step, reason=why, message=why))
            case Resumed(step=step):
                job.state = JobState.RUNNING
                await self.publish(JobResumed(job=job.id, step=step, message=f"step {step}"))
            case Checkpointed(step=step, path=path, stall_s=stall):
                job.last_checkpoint_step = step
                if job.state is JobState.CHECKPOINTING:
                    job.state = JobState.RUNNING
                move_stall(job, stall)
                await self.publish(
                    JobCheckpointed(
                        job=job.id,
                        step=step,
                        path=path,
                        stall_s=stall,
                        message=f"step {step} durable at {path} (training blocked {stall:.3f} s)",
                    )
                )
            case Finished(outcome=outcome, step=step):
                job.finished, job.step = outcome, max(job.step, step)
                for action in policy.all_exited(job):
                    await self.apply(job, action)

    # -- actions ----------------------------------------------------------------------

    async def apply(self, job: JobRecord, action: policy.Action) -> None:
        log.info("policy action", job=job.id, action=repr(action))
        match action:
            case policy.PauseJob(key=key, reason=reason):
                await self._pause(job, key, reason)
            case policy.ResumeJob(key=key, reason=reason):
                job.pause_reasons, last = policy.close_reason(job.pause_reasons, key)
                if last:
                    await self._to_rank0(job, Resume(job=job.id, reason=reason))
            case policy.CheckpointJob(reason=reason):
                await self._checkpoint(job, reason)
            case policy.DrainNode(node=node, reason=reason):
                self.registry.drain(node, reason)
            case policy.ResyncNode(node=node, reason=reason):
                await self._resync(node, reason)
            case policy.RestartJob(reason=reason, exclude=exclude):
                await self._recover(job, reason, exclude)
            case policy.FinishJob(state=state, reason=reason):
                await self._finish(job, state, reason)
        self._dirty.add(job.id)

    async def _pause(self, job: JobRecord, key: str, reason: str) -> None:
        job.pause_reasons, first = policy.open_reason(job.pause_reasons, key)
        if first:
            await self._to_rank0(job, Pause(job=job.id, reason=reason))

    async def _checkpoint(self, job: JobRecord, reason: str) -> None:
        reply = await self._to_rank0(job, CheckpointNow(job=job.id, reason=reason))
        if reply and job.state is JobState.RUNNING:
            job.state = JobState.CHECKPOINTING

    async def _to_rank0(self, job: JobRecord, cmd: Pause | Resume | CheckpointNow) -> bool:
        if not job.nodes:
            return False
        reply = await self.cmd.send(job.nodes[0], cmd)
        if not reply.ok:
            log.warning("command failed", job=job.id, node=job.nodes[0], error=reply.error)
        return reply.ok

    async def _stop(self, job: JobRecord, reason: str) -> None:
        job.stopping, job.reason = True, reason
        if not job.nodes:
            await self._finish(job, JobState.STOPPED, reason)
            return
        grace = 15.0
        await self.cmd.send_all(
            job.nodes, lambda: Stop(job=job.id, reason=reason, grace_s=grace), grace + 15
        )

    async def _recover(self, job: JobRecord, reason: str, exclude: tuple[str, ...]) -> None:
        job.state, job.reason = JobState.RECOVERING, reason
        job.restarts += 1
        job.failed_at_step = job.step
        job.excluded = sorted({*job.excluded, *exclude})
        await self.publish(
            JobRecovering(
                job=job.id,
                severity=Severity.WARNING,
                reason=reason,
                restarts=job.restarts,
                message=reason,
            )
        )
        await self.cmd.send_all(job.nodes, lambda: Stop(job=job.id, reason=reason, force=True))
        await self.save(job)

    async def _finish(self, job: JobRecord, state: JobState, reason: str) -> None:
        if job.state.terminal:
            return
        live = [n for n in job.nodes if n in self.registry.nodes]
        if state is not JobState.COMPLETED and live:
            await self.cmd.send_all(live, lambda: Stop(job=job.id, reason=reason, force=True))
        job.state, job.reason, job.finished_at = state, reason, time.time()
        event: EventBase
        if state is JobState.COMPLETED:
            event = JobCompleted(job=job.id, step=job.step, message=reason)
        elif state is JobState.STOPPED:
            event = JobStopped(job=job.id, step=job.step, reason=reason, message=reason)
        else:
            event = JobFailed(job=job.id, severity=Severity.CRITICAL, reason=reason, message=reason)
        await self.save(job)
        await self.publish(event)

    # -- periodic ---------------------------------------------------------------------

    async def tick(self) -> None:
        now = time.time()
        for job in list(self.jobs.values()):
            if job.state.terminal:
                continue
            account(job, now)
            self._dirty.add(job.id)
            if job.state in (JobState.PENDING, JobState.RECOVERING) and not job.stopping:
                task = self._starting.get(job.id)
                if task is None or task.done():
                    self._starting[job.id] = asyncio.create_task(self._start_logged(job))
            exited = self._exited_at.get(job.id)
            if exited is not None and time.monotonic() - exited > 5.0:
                for action in policy.overdue(job):
                    await self.apply(job, action)
        await self.flush()

    async def _explain(self, job: JobRecord, skipped: dict[str, str]) -> None:
        """One ``node.refused`` event per node and reason, so ``tail`` says why a node was
        passed over (busy nodes are not news)."""
        told = self._refusals.setdefault(job.id, {})
        for node, reason in skipped.items():
            if told.get(node) != reason and not reason.startswith("busy"):
                told[node] = reason
                await self.publish(
                    NodeRefused(
                        node=node,
                        job=job.id,
                        severity=Severity.WARNING,
                        reason=reason,
                        message=f"{node} not admitted: {reason}",
                    )
                )

    async def _start_logged(self, job: JobRecord) -> None:
        try:
            await self._start(job)
        except Exception as exc:  # retried on the next tick
            log.error("job start failed", job=job.id, error=repr(exc))

    async def _start(self, job: JobRecord) -> None:
        """Admission → master port → launch on every node (a failure undoes the launch)."""
        spec = job.spec.job
        busy = {
            n
            for j in self.jobs.values()
            if j.id != job.id and not j.state.terminal
            for n in j.nodes
        }
        adm = admit(
            list(self.registry.nodes.values()),
            spec.nodes,
            spec.gpus_per_node,
            busy,
            set(job.excluded),
        )
        if not adm.chosen:
            why = f"waiting for {spec.nodes} healthy nodes; skipped: " + (
                "; ".join(f"{n}: {r}" for n, r in adm.skipped.items()) or "none registered"
            )
            if self._waiting_logged.get(job.id) != why:
                self._waiting_logged[job.id] = why
                log.info("job waiting", job=job.id, why=why)
                job.reason = why
                await self._explain(job, adm.skipped)
            return
        nodes = [n.id for n in adm.chosen]
        reply = await self.cmd.send(nodes[0], ReservePort(job=job.id))
        if not reply.ok:
            job.reason = f"master {nodes[0]} could not reserve a port: {reply.error}"
            return
        restarting = job.state is JobState.RECOVERING
        job.attempt += 1
        job.exited_ranks, job.finished = {}, ""
        self._exited_at.pop(job.id, None)
        job.nodes, job.world_size = nodes, len(nodes) * spec.gpus_per_node
        job.master_addr, job.master_port = adm.chosen[0].addr, reply.port
        job.state, job.started_at = JobState.STARTING, job.started_at or time.time()
        await self.save(job)
        plans = plan(adm.chosen, spec.gpus_per_node, reply.port, spec.env)
        replies = await asyncio.gather(
            *(
                self.cmd.send(
                    p.node,
                    Launch(
                        job=job.id,
                        ranks=p.ranks,
                        spec=job.spec,
                        argv=spec.entry or [],
                        env=p.env,
                        workdir=job.workdir,
                        attempt=job.attempt,
                        pre_start=spec.pre_start,
                    ),
                    timeout=30 + (spec.pre_start_timeout_s if spec.pre_start else 0),
                )
                for p in plans
            )
        )
        failed = {r.node: r.error for r in replies if not r.ok}
        if failed:
            job.reason = "launch failed: " + "; ".join(f"{n}: {e}" for n, e in failed.items())
            log.warning("launch failed", job=job.id, failed=failed)
            await self.cmd.send_all(nodes, lambda: Stop(job=job.id, force=True, reason="undo"))
            job.state = JobState.RECOVERING if restarting else JobState.PENDING
            await self.save(job)
            return
        job.reason = ""
        if spec.entry:
            job.state = JobState.RUNNING  # a user's script sends no progress: running now
        await self._explain(job, adm.skipped)
        message = f"{job.world_size} ranks on {', '.join(nodes)}; master {job.master_addr}"
        if restarting:
            event: EventBase = JobRestarted(
                job=job.id,
                restarts=job.restarts,
                world_size=job.world_size,
                nodes=nodes,
                from_step=job.last_checkpoint_step or 0,
                message=message,
            )
        else:
            event = JobStarted(
                job=job.id,
                world_size=job.world_size,
                nodes=nodes,
                master_addr=job.master_addr,
                master_port=job.master_port,
                skipped=adm.skipped,
                message=message,
            )
        await self.save(job)
        await self.publish(event)
