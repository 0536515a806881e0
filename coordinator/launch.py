"""Starting an attempt of a job: admission → the master's port → launch on every node.

A failure on any node undoes the launch everywhere and leaves the job where it was, to be
tried again on the next tick. The record is saved (compare-and-set) before any node is
told to start ranks, so a deposed leader cannot launch what its successor does not know.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import structlog

from coordinator import exclusion, loop_support
from coordinator.commander import CommandSender
from coordinator.job_machine import Input, fire
from coordinator.placement_policy import allocation_wait, minimum_nodes
from coordinator.registry import Registry
from coordinator.rendezvous import admit, plan
from coordinator.resume_point import Tier, expected_resume
from proto.commands import Launch, ReservePort, Stop
from proto.events import (
    EventBase,
    JobGrown,
    JobPending,
    JobRestarted,
    JobShrunk,
    JobStarted,
    NodeRefused,
    Severity,
)
from proto.job import GivenUp, JobRecord, JobState
from ringmaster.clock import Clock

log = structlog.get_logger()
Publish = Callable[[EventBase], Awaitable[None]]
Save = Callable[[JobRecord], Awaitable[None]]


class Launcher:
    def __init__(
        self, cmd: CommandSender, registry: Registry, publish: Publish, save: Save, clock: Clock
    ) -> None:
        self.cmd, self.registry, self.publish, self.save = cmd, registry, publish, save
        self.clock = clock  # the job manager's
        self._waiting_logged: dict[str, str] = {}
        self._refusals: dict[str, dict[str, str]] = {}
        # each job's newest attempt and when every node answered its launch (monotonic;
        # inf while one is in flight), and each node's own clock at its answer: a beat
        # that node sent after it lists the attempt's ranks (coordinator.job_reconcile)
        self.launched_at: dict[str, tuple[int, float]] = {}
        self.answered_at: dict[str, dict[str, float]] = {}
        # and when each answering agent process started (coordinator.reconcile.knows_launch)
        self.answered_by: dict[str, dict[str, float]] = {}

    async def start(self, job: JobRecord, busy: set[str]) -> bool:
        """One try at starting ``job``'s next attempt; True when every node launched.
        A restart may run on fewer nodes, down to ``[job] min_nodes`` (a data-parallel
        job shrinks rather than wait), and holds ``[job] spares`` more for the next one."""
        spec = job.spec.job
        restarting = job.state is JobState.RECOVERING
        minimum = minimum_nodes(job)
        adm = admit(
            list(self.registry.nodes.values()),
            spec.nodes,
            spec.gpus_per_node,
            busy,
            exclusion.left_out(job, self.registry.nodes, self.clock.time()),
            minimum=minimum,
            spares=spec.spares,
        )
        if not adm.chosen:
            job.waiting_since = job.waiting_since or self.clock.time()
            need = f"{minimum}" if minimum == spec.nodes else f"{minimum} to {spec.nodes}"
            why = f"waiting for {need} healthy nodes; skipped: " + (
                "; ".join(f"{n}: {r}" for n, r in adm.skipped.items()) or "none registered"
            )
            if self._waiting_logged.get(job.id) != why:
                self._waiting_logged[job.id] = why
                log.info("job waiting", job=job.id, why=why)
                job.reason = why
                await self.publish(self._pending(job, adm.skipped, why))
                await self.explain(job, adm.skipped)
            return False
        nodes = [n.id for n in adm.chosen]
        reply = await self.cmd.send(nodes[0], ReservePort(job=job.id))
        if not reply.ok:
            job.reason = f"master {nodes[0]} could not reserve a port: {reply.error}"
            return False
        previous, previous_nodes = job.world_size, job.nodes
        if job.attempt and previous_nodes:
            job.given_up = GivenUp(
                attempt=job.attempt, node=previous_nodes[0], world_size=job.world_size
            )
        job.attempt += 1
        job.exited_ranks, job.finished = {}, ""
        job.nodes, job.world_size = nodes, len(nodes) * spec.gpus_per_node
        job.spare_nodes, job.waiting_since = adm.spares, None
        job.attempt_started_at = now = self.clock.time()
        job.master_addr, job.master_port = adm.chosen[0].addr, reply.port
        job.started_at = job.started_at or now
        fire(job, Input.LAUNCH)
        # until every node has answered, a node's beat may not list a rank it is starting
        self.launched_at[job.id] = (job.attempt, math.inf)
        self.answered_at.pop(job.id, None)
        self.answered_by.pop(job.id, None)
        await self.save(job)
        plans = plan(adm.chosen, spec.gpus_per_node, reply.port, spec.env)
        probes = {n.id: f"{n.addr}:{n.probe_port}" for n in adm.chosen if n.probe_port}
        timeout = 30 + (spec.pre_start_timeout_s if spec.pre_start else 0)
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
                        peers={n: a for n, a in probes.items() if n != p.node},
                    ),
                    timeout=timeout,
                )
                for p in plans
            )
        )
        failed = {
            r.node or p.node: r.error for p, r in zip(plans, replies, strict=True) if not r.ok
        }
        if failed:
            job.reason = "launch failed: " + "; ".join(f"{n}: {e}" for n, e in failed.items())
            log.warning("launch failed", job=job.id, failed=failed)
            await self.cmd.send_all(nodes, lambda: Stop(job=job.id, force=True, reason="undo"))
            fire(job, Input.UNDO_RELAUNCH if restarting else Input.UNDO_FIRST_LAUNCH)
            await self.save(job)
            return False
        self.launched_at[job.id] = (job.attempt, self.clock.monotonic())
        self.answered_at[job.id] = {p.node: r.sent_at for p, r in zip(plans, replies, strict=True)}
        self.answered_by[job.id] = {
            p.node: r.started_at for p, r in zip(plans, replies, strict=True)
        }
        job.reason = ""
        if not loop_support.reports_steps(job):
            fire(job, Input.TRAINING)  # a script that sends no progress: running now
        await self.explain(job, adm.skipped)
        await self.save(job)
        resume = expected_resume(
            previous_nodes,
            job.nodes,
            job.world_size == previous,
            job.memory_step,
            job.last_checkpoint_step,
        )
        await self.publish(self._started(job, restarting, adm.skipped, resume))
        if previous and job.world_size != previous:
            await self.publish(self._resized(job, previous))
        return True

    @staticmethod
    def _pending(job: JobRecord, skipped: dict[str, str], why: str) -> JobPending:
        """Why the job waits, said each time that changes: the nodes passed over (busy
        ones aside) and, inside an allocation, how long before it stops to be requeued
        without them."""
        bound = allocation_wait(job)
        if job.allocation is not None and bound is not None:
            why += f"; stops to be requeued in {bound:g} s unless they can be used"
        return JobPending(
            job=job.id,
            severity=Severity.WARNING if job.allocation is not None else Severity.INFO,
            waiting_for={
                n: r for n, r in skipped.items() if not r.startswith(("busy", "outside Slurm"))
            },
            bound_s=bound if job.allocation is not None else None,
            message=why,
        )

    @staticmethod
    def _resized(job: JobRecord, previous: int) -> EventBase:
        kind = JobShrunk if job.world_size < previous else JobGrown
        wanted = job.spec.job.nodes
        return kind(
            job=job.id,
            severity=Severity.WARNING if len(job.nodes) < wanted else Severity.INFO,
            world_size=job.world_size,
            previous_world_size=previous,
            nodes=job.nodes,
            message=f"world size {previous} → {job.world_size}: {len(job.nodes)} of "
            f"{wanted} nodes ({', '.join(job.nodes)})",
        )

    @staticmethod
    def _started(
        job: JobRecord, restarting: bool, skipped: dict[str, str], resume: tuple[Tier, int]
    ) -> EventBase:
        message = f"{job.world_size} ranks on {', '.join(job.nodes)}; master {job.master_addr}"
        if restarting:
            tier, step = resume
            said = f"resume: {tier} step {step}"
            if not loop_support.reports_steps(job):
                said = "resume: wherever the script's own checkpoints are (it reports no steps)"
            return JobRestarted(
                job=job.id,
                restarts=job.restarts,
                world_size=job.world_size,
                nodes=job.nodes,
                from_step=step,
                message=f"{message}; {said}",
            )
        if job.resume_step is None:
            origin = "fresh start"
        else:
            origin = f"resuming from step {job.resume_step} (job {job.resume_job or 'unrecorded'})"
        return JobStarted(
            job=job.id,
            world_size=job.world_size,
            nodes=job.nodes,
            master_addr=job.master_addr,
            master_port=job.master_port,
            skipped=skipped,
            resume_step=job.resume_step,
            resume_job=job.resume_job,
            message=f"{origin}; {message}",
        )

    async def explain(self, job: JobRecord, skipped: dict[str, str]) -> None:
        """One ``node.refused`` event per node and reason, so ``tail`` says why a node was
        passed over (busy nodes are not news): at admission, and when the policy refuses
        a node it measured (a slow link)."""
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
