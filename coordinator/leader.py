"""What only the leader does: consume events and progress, answer the API, tick jobs,
watch for lost nodes, keep every node's life (coordinator.node_keeper) and node records in
KV. Started on winning the lease, stopped
on losing it. Each duty is its own task, restarted (and logged) if it ever fails, so one
bad message or one slow KV write cannot silently stop the others."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from prometheus_client import Histogram
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from coordinator import node_life, pull
from coordinator.jobs import JobManager
from coordinator.kvstore import Buckets, KvCasStore
from coordinator.node_keeper import NodeKeeper
from coordinator.node_records import NodeRecords
from coordinator.registry import Registry
from coordinator.slurm_drains import POLL_S, SlurmDrains
from coordinator.slurm_jobs import SlurmAllocations
from proto import subjects
from proto.api import ApiReply
from proto.codec import (
    control_decoder,
    decode_event,
    encode,
    node_control_decoder,
    progress_decoder,
    submit_decoder,
)
from proto.events import NODE_REPORTED, EventBase, NodeAway, NodeLost, Severity, kind_of
from ringmaster.retry import backoff
from ringmaster.slurm import available as slurm_available

log = structlog.get_logger()
Handler = Callable[[str, bytes], Awaitable[None]]  # subject, data
DUTY_RESTART_FIRST_S, DUTY_RESTART_CAP_S = 0.5, 5.0  # a failed duty's jittered restart


class Leadership:
    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        cluster: str,
        me: str,
        buckets: Buckets,
        registry: Registry,
        jobs: JobManager,
        publish: Callable[[EventBase], Awaitable[None]],
        decisions: Histogram | None = None,
        alert: Callable[[EventBase], None] = lambda event: None,
        slurm: str = "off",
        probation: Mapping[str, float] = node_life.PROBATION_S,
    ) -> None:
        self.alert = alert  # node events reach the leader only here; its own via publish
        self.nc, self.js, self.cluster, self.me = nc, js, cluster, me
        self.buckets, self.registry, self.jobs, self.publish = buckets, registry, jobs, publish
        self.clock = jobs.clock  # one clock for the leader's decisions and its jobs'
        self.decisions = decisions  # event time → policy done (coordinator.metrics)
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Subscription] = []
        self.records = NodeRecords(registry, buckets.nodes, self.clock)
        self.keeper = NodeKeeper(
            registry,
            KvCasStore(buckets.lives),
            publish,
            self.jobs.operator_drained,
            self.clock,
            probation,
        )
        # drains in Slurm for what the nodes report (coordinator.slurm_drains), jobs whose
        # allocation is gone stopped (coordinator.slurm_jobs); None: off
        on = slurm != "off"
        self.slurm = SlurmDrains(lambda: self.registry.nodes.values(), publish) if on else None
        self.allocations = (
            SlurmAllocations(lambda: list(self.jobs.jobs.values()), self.jobs.control)
            if on
            else None
        )
        # auto: a round runs only while Slurm's commands and configuration are there
        self._slurm_here = slurm_available if slurm == "auto" else lambda: True

    async def start(self) -> None:
        await self.jobs.load()
        self.jobs.reconciler.reset()
        await self.keeper.load()
        self._subs = [
            await self.nc.subscribe(subjects.api(self.cluster, "submit"), cb=self._on_submit),
            await self.nc.subscribe(subjects.api(self.cluster, "control"), cb=self._on_control),
            await self.nc.subscribe(subjects.api(self.cluster, "node"), cb=self._on_node),
        ]
        events, progress = (
            subjects.events_stream(self.cluster),
            subjects.progress_stream(self.cluster),
        )
        duties: dict[str, Callable[[], Awaitable[None]]] = {
            "events": lambda: self._consume(events, "coordinator-events", self._on_event),
            "progress": lambda: self._consume(progress, "coordinator-progress", self._on_progress),
            "jobs": lambda: self._every(0.25, self._tick),
            "nodes": lambda: self._every(1.0, self.records.write),
        }
        if (drains := self.slurm) is not None and (allocs := self.allocations) is not None:
            duties["slurm"] = lambda: self._every(POLL_S, self._in_slurm(drains.reconcile))
            duties["allocations"] = lambda: self._every(POLL_S, self._in_slurm(allocs.reconcile))
        self._tasks = [
            asyncio.create_task(self._forever(name, duty), name=name)
            for name, duty in duties.items()
        ]

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self.jobs.abandon()
        self.keeper.stop()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        self._subs, self._tasks = [], []

    @staticmethod
    async def _forever(name: str, duty: Callable[[], Awaitable[None]]) -> None:
        """Run ``duty`` for as long as this leader leads. Whatever it raises is logged and
        the duty started again after the project's jittered backoff
        (:func:`ringmaster.retry.backoff`): a duty supervises itself, so, unlike a retried
        call, it names no exception types — one that stopped for good would leave the
        leader half-working. Cancellation (stepping down) is never retried."""

        def note(state: RetryCallState) -> None:
            failed = state.outcome.exception() if state.outcome else None
            log.error(
                "leader duty failed; restarting it",
                duty=name,
                error=repr(failed),
                in_s=round(state.upcoming_sleep, 2),
            )

        async for attempt in AsyncRetrying(
            wait=backoff(DUTY_RESTART_FIRST_S, DUTY_RESTART_CAP_S),
            retry=retry_if_exception_type(Exception),
            before_sleep=note,
            reraise=True,
        ):
            with attempt:
                await duty()

    def _in_slurm(self, work: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """``work``, skipped in a round where Slurm is not there (``--slurm auto``)."""

        async def round_() -> None:
            if await asyncio.to_thread(self._slurm_here):
                await work()

        return round_

    @staticmethod
    async def _every(period: float, work: Callable[[], Awaitable[None]]) -> None:
        """Pacing, on the machine's own clock: nothing here decides, so a test's manual
        clock (which the duties' decisions read) need not move for a duty to run again."""
        while True:
            started = time.monotonic()
            await work()
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def _consume(self, stream: str, name: str, handle: Handler) -> None:
        """A durable pull consumer: a new leader resumes exactly where the last one acked.
        Each message is handled as it arrives (:mod:`coordinator.pull`), then acked."""
        config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=1000)
        await pull.durable(self.js, stream, name, config)

        async def handled(msg: Msg) -> None:
            try:
                await handle(msg.subject, msg.data)
            except Exception as exc:
                log.error("handling failed", stream=stream, error=repr(exc))
            await msg.ack()

        await pull.Puller(self.nc, stream, name).run(handled)

    async def _on_event(self, subject: str, data: bytes) -> None:
        try:
            event = decode_event(data)
        except msgspec.DecodeError as exc:
            log.warning("ignored a malformed event", error=str(exc))
            return
        if kind_of(event).startswith(("job.", "coordinator.")):
            return
        sender = subjects.sender(subject)
        if (sender is not None or isinstance(event, NODE_REPORTED)) and event.node != sender:
            # the bus lets an agent publish only on its own node's subjects: a node named
            # in the body that is not the one in the subject is a forgery or a bug
            log.warning("ignored an event naming another node", subject=subject, node=event.node)
            return
        self.alert(event)
        if event.condition is not None:
            self.registry.observe_condition(event.condition)
        await self.jobs.on_event(event)
        if self.decisions is not None:
            self.decisions.observe(max(0.0, self.clock.time() - event.time.timestamp()))

    async def _on_progress(self, subject: str, data: bytes) -> None:
        sender = subjects.sender(subject)
        if sender is None:
            log.warning("ignored progress on a subject naming no node", subject=subject)
            return
        try:
            await self.jobs.on_progress(progress_decoder.decode(data), sender)
        except msgspec.DecodeError as exc:
            log.warning("ignored malformed progress", error=str(exc))

    async def _tick(self) -> None:
        now = self.clock.monotonic()
        away, lost = self.registry.sweep(now)
        for node in away:
            grace = self.registry.away_grace_s
            then = f"lost unless it beats again or its job's ranks step on ({grace:g} s)"
            if sum(r.alive for r in node.ranks):
                then = f"its job decides from its peers' steps; {then}"
            silent = f"agent away: no heartbeat for {now - node.last_seen:.1f} s; {then}"
            await self.publish(self._silence(NodeAway, node.id, Severity.WARNING, silent))
        for node in lost:
            silent = f"no heartbeat for {now - node.last_seen:.1f} s; {node.lost_reason}"
            await self.publish(self._silence(NodeLost, node.id, Severity.CRITICAL, silent))
        await self.keeper.tick()  # before the jobs: admission reads each node's life
        await self.jobs.tick()

    def _silence(
        self, kind: type[NodeAway | NodeLost], node: str, severity: Severity, message: str
    ) -> NodeAway | NodeLost:
        missed = self.registry.missed_beats
        return kind(node=node, severity=severity, missed_beats=missed, message=message)

    async def _on_submit(self, msg: Msg) -> None:
        await self._answer(
            msg, "submit", lambda data: self.jobs.submit(submit_decoder.decode(data))
        )

    async def _on_control(self, msg: Msg) -> None:
        await self._answer(
            msg, "control", lambda data: self.jobs.control(control_decoder.decode(data))
        )

    async def _on_node(self, msg: Msg) -> None:
        await self._answer(
            msg, "node", lambda data: self.keeper.control(node_control_decoder.decode(data))
        )

    async def _answer(
        self, msg: Msg, verb: str, handle: Callable[[bytes], Awaitable[ApiReply]]
    ) -> None:
        """Every API request gets a reply: a malformed request or a failure is an error
        reply the CLI prints as one line, never a timeout."""
        try:
            reply = await handle(msg.data)
        except msgspec.DecodeError as exc:
            reply = ApiReply(ok=False, error=f"invalid {verb} request: {exc}")
        except Exception as exc:
            reply = ApiReply(ok=False, error=f"{verb} failed: {exc}")
        reply.error = reply.error.replace("\r", "\\r").replace("\n", "\\n")  # one line
        reply.coordinator = self.me
        await msg.respond(encode(reply))
