"""Restarting a job: stopping the old attempt (at once, or gracefully at a step boundary
with a checkpoint first), finding which of its nodes are gone, and growing a shrunk job
back. The decisions are the policy's (:mod:`coordinator.policy`); this is their I/O.

While an attempt is being stopped the job is *held*: the job manager does not launch the
next attempt until every node has answered the stop, so a graceful stop's checkpoint is
never cut short by the relaunch, and no launch meets ranks that are still alive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from coordinator.commander import CommandSender
from coordinator.goodput import charge_detection
from coordinator.registry import Registry
from proto.commands import Ping, Stop
from proto.events import EventBase, JobRecovering, Severity
from proto.job import JobRecord, JobState

log = structlog.get_logger()
Publish = Callable[[EventBase], Awaitable[None]]
Save = Callable[[JobRecord], Awaitable[None]]

PING_TIMEOUT_S = 1.0
GRACE_S = 20.0  # a graceful stop's time to reach a boundary and make its checkpoint durable
GROW_AFTER_S = 30.0  # a shrunk job runs this long on its nodes before growing back


class Recovery:
    def __init__(
        self, cmd: CommandSender, registry: Registry, publish: Publish, save: Save
    ) -> None:
        self.cmd, self.registry, self.publish, self.save = cmd, registry, publish, save
        self.held: set[str] = set()  # jobs whose old attempt is being stopped
        self._pinged: dict[tuple[str, int], frozenset[str]] = {}

    async def restart(
        self, job: JobRecord, reason: str, exclude: tuple[str, ...], charged: bool, graceful: bool
    ) -> None:
        charge_detection(job, time.time())
        job.state, job.reason = JobState.RECOVERING, reason
        if charged:
            job.restarts += 1
            job.failing_at_step = max(job.step, job.failing_at_step if job.restarts_in_row else 0)
            job.restarts_in_row += 1
        job.failed_at_step = job.step
        job.excluded = sorted({*job.excluded, *exclude})
        await self.save(job)
        await self.publish(
            JobRecovering(
                job=job.id,
                severity=Severity.WARNING,
                reason=reason,
                restarts=job.restarts,
                message=reason + (" (checkpointing at the next step first)" if graceful else ""),
            )
        )
        # a node known to be gone would only make the stop wait for its timeout
        gone = self.registry.silent(job.nodes, time.monotonic())
        live = [n for n in job.nodes if n in self.registry.nodes and n not in gone]
        self.held.add(job.id)
        try:
            await self.cmd.send_all(
                live,
                lambda: Stop(job=job.id, reason=reason, force=not graceful, grace_s=GRACE_S),
                GRACE_S + 15,
            )
        finally:
            self.held.discard(job.id)

    async def unreachable(self, job: JobRecord) -> frozenset[str]:
        """The job's nodes whose agent does not answer a ping (asked once per attempt):
        evidence, unlike a missed beat's wait, within a second. Nobody when no node
        answers at all, which says more about the bus than about the nodes."""
        key = (job.id, job.attempt)
        if key not in self._pinged:
            replies = await asyncio.gather(
                *(self.cmd.send(n, Ping(job=job.id), PING_TIMEOUT_S) for n in job.nodes)
            )
            silent = {n for n, r in zip(job.nodes, replies, strict=True) if not r.answered}
            if len(silent) == len(job.nodes):
                silent = set()
            for node in silent:
                log.warning("node did not answer a ping", job=job.id, node=node)
                self.registry.suspect(node, time.monotonic())
            self._pinged = {k: v for k, v in self._pinged.items() if k[0] != job.id}
            self._pinged[key] = frozenset(silent)
        return self._pinged[key]


def grow_reason(job: JobRecord, free: list[str], now: float) -> str | None:
    """Why a shrunk job should restart onto more nodes now, if it should: it runs on
    fewer nodes than it asked for, healthy free nodes exist, and it has run on its
    current nodes long enough not to flap."""
    missing = job.spec.job.nodes - len(job.nodes)
    if job.state is not JobState.RUNNING or missing <= 0 or not free or job.stopping:
        return None
    if job.first_step_at is None or now - (job.attempt_started_at or 0.0) < GROW_AFTER_S:
        return None
    return f"growing back to {job.spec.job.nodes} nodes: {', '.join(free[:missing])} healthy"
