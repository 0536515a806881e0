"""Stopping ranks, as tasks: a given-up attempt before the next launch (at once, or
gracefully at a step boundary with a checkpoint first), the operator's stop of a whole job,
and orphans that reconciliation found; finding which of a job's nodes are gone; growing a
shrunk job back. The decisions are the policy's and the state machine's
(:mod:`coordinator.job_machine`); this is their I/O, and it never decides.

No handler awaits a stop: the job manager starts one of these as a task and feeds its
end back to the state machine as an input, so one job's slow evacuation never delays
another job's fault handling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from coordinator import loop_support
from coordinator.commander import CommandSender
from coordinator.registry import Registry
from proto.commands import Ping, Stop
from proto.job import JobRecord, JobState
from proto.progress import Reaction
from ringmaster.clock import Clock

log = structlog.get_logger()

PING_TIMEOUT_S = 1.0
GRACE_S = 20.0  # a graceful stop's time to reach a boundary and make its checkpoint durable
STOP_GRACE_S = 15.0  # the operator's stop: ranks get this long, then the job is stopped
GROW_AFTER_S = 30.0  # a shrunk job runs this long on its nodes before growing back


class Stopper:
    def __init__(self, cmd: CommandSender, registry: Registry, clock: Clock) -> None:
        self.cmd, self.registry, self.clock = cmd, registry, clock  # the job manager's clock
        self._pinged: dict[tuple[str, int], frozenset[str]] = {}

    def reachable(self, nodes: list[str]) -> list[str]:
        """A node known to be gone would only make a stop wait for its timeout."""
        gone = self.registry.silent(nodes, self.clock.monotonic())
        return [n for n in nodes if n in self.registry.nodes and n not in gone]

    async def stop_attempt(
        self, job: str, nodes: list[str], attempt: int, reason: str, graceful: bool
    ) -> None:
        """Stop ``attempt``'s ranks on ``nodes`` (never a later attempt's)."""
        await self.cmd.send_all(
            self.reachable(nodes),
            lambda: Stop(
                job=job, reason=reason, force=not graceful, grace_s=GRACE_S, attempt=attempt
            ),
            GRACE_S + 15,
        )

    async def stop_job(
        self, job: str, nodes: list[str], reason: str, at_boundary: bool = True
    ) -> list[str]:
        """The operator's stop: graceful on every node (``at_boundary``: the loop stops at
        a step boundary when asked; else its ranks are terminated at once, as a wait for a
        boundary it never reaches would only spend the grace), bounded by
        ``STOP_GRACE_S`` and a margin whatever the nodes do. Returns the nodes that did not
        confirm."""
        send = self.cmd.send_all(
            nodes,
            lambda: Stop(job=job, reason=reason, force=not at_boundary, grace_s=STOP_GRACE_S),
            STOP_GRACE_S + 4,
        )
        try:
            replies = await asyncio.wait_for(send, STOP_GRACE_S + 5)
        except TimeoutError:
            return list(nodes)
        return sorted(n for n, r in replies.items() if not r.ok)

    async def kill(self, job: str, nodes: list[str], reason: str, attempt: int = 0) -> None:
        """Kill what runs of ``job`` (of ``attempt`` and before; 0: any) on ``nodes``."""
        await self.cmd.send_all(
            self.reachable(nodes),
            lambda: Stop(job=job, reason=reason, force=True, attempt=attempt),
            15,
        )

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
                self.registry.suspect(node, self.clock.monotonic())
            self._pinged = {k: v for k, v in self._pinged.items() if k[0] != job.id}
            self._pinged[key] = frozenset(silent)
        return self._pinged[key]


def grow_reason(job: JobRecord, free: Callable[[], list[str]], now: float) -> str | None:
    """Why a shrunk job should restart onto more nodes now, if it should: it runs on
    fewer nodes than it asked for, has run on its current nodes long enough not to flap,
    and healthy free nodes exist (``free`` lists them; a scan of every node, asked only
    of a job that could grow)."""
    missing = job.spec.job.nodes - len(job.nodes)
    if job.state is not JobState.RUNNING or missing <= 0 or job.stopping:
        return None
    if loop_support.lacking(job, Reaction.CHECKPOINT) is not None:
        return None  # a restart would throw away the work since the script's own save
    if job.first_step_at is None or now - (job.attempt_started_at or 0.0) < GROW_AFTER_S:
        return None
    if not (found := free()):
        return None
    return f"growing back to {job.spec.job.nodes} nodes: {', '.join(found[:missing])} healthy"
