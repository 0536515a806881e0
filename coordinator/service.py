"""The coordinator process: every instance keeps the node registry warm from heartbeats and
runs the election; only the leader consumes events, answers the API and drives jobs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from coordinator.commander import Commander
from coordinator.election import Election, Role
from coordinator.jobs import JobManager
from coordinator.kvstore import Buckets, KvCasStore, ensure_layout
from coordinator.registry import Registry
from proto import subjects
from proto.api import ApiReply
from proto.codec import (
    control_decoder,
    decode_event,
    encode,
    heartbeat_decoder,
    progress_decoder,
    submit_decoder,
)
from proto.events import (
    CoordinatorLeader,
    EventBase,
    NodeLost,
    NvmeLatencyRecovered,
    NvmeLatencySpike,
    NvmeReadonly,
    Severity,
    kind_of,
)
from proto.node import CoordinatorRecord, NodeRecord
from ringmaster.bus import connect, publish_event

log = structlog.get_logger()
Handler = Callable[[bytes], Awaitable[None]]
NODE_REFRESH_S = 5.0


class Coordinator:
    def __init__(
        self, nats_url: str, cluster: str, me: str, ttl: float = 2.0, replicas: int = 1
    ) -> None:
        self.nats_url, self.cluster, self.me, self.ttl = nats_url, cluster, me, ttl
        self.replicas = replicas
        self.registry = Registry()
        self._lead_tasks: list[asyncio.Task[None]] = []
        self._lead_subs: list[Subscription] = []
        self._node_written: dict[str, tuple[object, float]] = {}

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.nats_url, self.me)
        js = nc.jetstream()
        buckets = await self._layout(js, stop)
        self.nc, self.js, self.buckets = nc, js, buckets
        election = Election(KvCasStore(buckets.leader), self.me, self.ttl)
        self.election = election
        commander = Commander(nc, self.cluster, self.me, lambda: election.epoch)
        self.jobs = JobManager(buckets.jobs, commander, self.registry, self.publish)

        async def on_beat(msg: Msg) -> None:
            with contextlib.suppress(msgspec.DecodeError):
                self.registry.observe(heartbeat_decoder.decode(msg.data), time.monotonic())

        await nc.subscribe(subjects.heartbeats(self.cluster), cb=on_beat)
        log.info("coordinator running", id=self.me, cluster=self.cluster)
        try:
            while not stop.is_set():
                was = election.role
                try:
                    role = await asyncio.wait_for(election.step(), timeout=self.ttl / 2)
                except Exception as exc:
                    log.warning("election round failed", error=repr(exc))
                    role = election.role
                if role is Role.LEADER and was is not Role.LEADER:
                    await self._lead(buckets, js)
                elif role is not Role.LEADER and was is Role.LEADER:
                    log.warning("lost leadership", id=self.me)
                    await self._unlead()
                await self._presence(buckets)
                pause = election.renew_every if role is Role.LEADER else 0.2
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=pause)
        finally:
            await self._unlead()
            with contextlib.suppress(Exception):
                await election.release()
            with contextlib.suppress(Exception):
                await buckets.members.delete(self.me)
            with contextlib.suppress(Exception):
                # close, not drain: draining waits for pull subscriptions' open fetches.
                await nc.close()

    async def _layout(self, js: JetStreamContext, stop: asyncio.Event) -> Buckets:
        """Streams and buckets, retried while JetStream is not ready (a clustered server
        still electing its meta leader, say)."""
        delay = 0.2
        while True:
            try:
                return await ensure_layout(js, self.cluster, self.replicas)
            except Exception as exc:
                if stop.is_set():
                    raise
                log.warning("JetStream not ready, retrying", error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def publish(self, event: EventBase) -> None:
        await publish_event(self.js, self.cluster, event)

    async def _presence(self, buckets: Buckets) -> None:
        record = CoordinatorRecord(
            id=self.me,
            role=self.election.role.value,
            epoch=self.election.epoch,
            pid=os.getpid(),
            updated_at=time.time(),
        )
        with contextlib.suppress(Exception):
            await buckets.members.put(self.me, encode(record))

    # -- leadership -------------------------------------------------------------------

    async def _lead(self, buckets: Buckets, js: JetStreamContext) -> None:
        epoch = self.election.epoch
        log.info("leading", id=self.me, epoch=epoch)
        await self.jobs.load()
        await self.publish(
            CoordinatorLeader(coordinator=self.me, epoch=epoch, message=f"{self.me} leads")
        )
        nc = self.nc
        self._lead_subs = [
            await nc.subscribe(subjects.api(self.cluster, "submit"), cb=self._on_submit),
            await nc.subscribe(subjects.api(self.cluster, "control"), cb=self._on_control),
        ]
        self._lead_tasks = [
            asyncio.create_task(
                self._consume(
                    js,
                    subjects.events_stream(self.cluster),
                    "coordinator-events",
                    self._on_event_data,
                )
            ),
            asyncio.create_task(
                self._consume(
                    js,
                    subjects.progress_stream(self.cluster),
                    "coordinator-progress",
                    self._on_progress_data,
                )
            ),
            asyncio.create_task(self._ticker(buckets)),
        ]

    async def _unlead(self) -> None:
        for sub in self._lead_subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for task in self._lead_tasks:
            task.cancel()
        if self._lead_tasks:
            await asyncio.wait(self._lead_tasks, timeout=5)
        self._lead_subs, self._lead_tasks = [], []

    async def _consume(
        self, js: JetStreamContext, stream: str, durable: str, handle: Handler
    ) -> None:
        """A durable pull consumer: a new leader resumes exactly where the last one acked."""
        config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=1000)
        sub = await js.pull_subscribe("", durable=durable, stream=stream, config=config)
        while True:
            try:
                msgs = await sub.fetch(batch=100, timeout=1.0)
            except (NatsTimeout, TimeoutError):
                continue
            for msg in msgs:
                try:
                    await handle(msg.data)
                except Exception as exc:
                    log.error("handling failed", stream=stream, error=repr(exc))
                await msg.ack()

    async def _on_event_data(self, data: bytes) -> None:
        try:
            event = decode_event(data)
        except msgspec.DecodeError as exc:
            log.warning("ignored a malformed event", error=str(exc))
            return
        kind = kind_of(event)
        if kind.startswith(("job.", "coordinator.")):
            return
        node = event.node or ""
        match event:
            case NvmeLatencySpike(device=dev):
                self.registry.set_fault(node, f"nvme:{dev}", f"NVMe {dev} latency spike")
            case NvmeLatencyRecovered(device=dev):
                self.registry.set_fault(node, f"nvme:{dev}", None)
            case NvmeReadonly(device=dev, readonly=ro):
                self.registry.set_fault(node, f"ro:{dev}", f"NVMe {dev} read-only" if ro else None)
        await self.jobs.on_event(event)

    async def _on_progress_data(self, data: bytes) -> None:
        try:
            await self.jobs.on_progress(progress_decoder.decode(data))
        except msgspec.DecodeError as exc:
            log.warning("ignored malformed progress", error=str(exc))

    async def _ticker(self, buckets: Buckets) -> None:
        last_nodes = 0.0
        while True:
            now = time.monotonic()
            for node in self.registry.sweep(now):
                await self.publish(
                    NodeLost(
                        node=node.id,
                        severity=Severity.CRITICAL,
                        missed_beats=self.registry.missed_beats,
                        message=f"no heartbeat for {now - node.last_seen:.1f} s",
                    )
                )
            try:
                await self.jobs.tick()
            except Exception as exc:
                log.error("job tick failed", error=repr(exc))
            if now - last_nodes >= 1.0:
                last_nodes = now
                await self._write_nodes(buckets)
            await asyncio.sleep(0.25)

    async def _write_nodes(self, buckets: Buckets) -> None:
        """Node records go to KV when what an operator sees changes (state, faults, jobs)
        and otherwise at most every ``NODE_REFRESH_S``: telemetry changes every beat, and
        10,000 nodes must not mean 10,000 KV writes a second."""
        wall, mono = time.time(), time.monotonic()
        for node in self.registry.nodes.values():
            key = (
                node.state,
                tuple(node.faults),
                tuple(node.jobs),
                node.drain_reason,
                node.preflight_ok,
                node.topology_ok,
            )
            written = self._node_written.get(node.id)
            if written is not None and written[0] == key and mono - written[1] < NODE_REFRESH_S:
                continue
            record = NodeRecord(
                id=node.id,
                state=node.state,
                addr=node.addr,
                hostname=node.hostname,
                gpus=node.gpus,
                simulated=node.simulated,
                last_seen=round(wall - (mono - node.last_seen), 1),
                telemetry=node.telemetry,
                faults=node.faults,
                jobs=node.jobs,
                drain_reason=node.drain_reason,
                preflight_ok=node.preflight_ok,
                topology_ok=node.topology_ok,
            )
            try:
                await buckets.nodes.put(node.id, encode(record))
            except Exception as exc:
                log.warning("node record not written", node=node.id, error=repr(exc))
                continue
            self._node_written[node.id] = (key, mono)

    async def _on_submit(self, msg: Msg) -> None:
        try:
            reply = await self.jobs.submit(submit_decoder.decode(msg.data))
        except msgspec.DecodeError as exc:
            reply = ApiReply(ok=False, error=f"invalid job: {exc}")
        except Exception as exc:
            reply = ApiReply(ok=False, error=f"submit failed: {exc}")
        reply.coordinator = self.me
        await msg.respond(encode(reply))

    async def _on_control(self, msg: Msg) -> None:
        try:
            reply = await self.jobs.control(control_decoder.decode(msg.data))
        except msgspec.DecodeError as exc:
            reply = ApiReply(ok=False, error=f"invalid request: {exc}")
        except Exception as exc:
            reply = ApiReply(ok=False, error=f"control failed: {exc}")
        reply.coordinator = self.me
        await msg.respond(encode(reply))
