"""The coordinator process: every instance keeps the node registry warm from heartbeats and
runs the election; only the leader does the work in :mod:`coordinator.leader`.

Three NATS connections keep the critical paths apart: one for the lease (renewals never
queue behind bulk traffic), one for heartbeats (10,000 a second at scale), one for
everything the leader does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Mapping

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from prometheus_client import Histogram

from coordinator import presence
from coordinator.alert_sender import Alerter
from coordinator.alerts import destinations
from coordinator.commander import Commander
from coordinator.election import Election, Role
from coordinator.jobs import JobManager
from coordinator.kvstore import Buckets, KvCasStore, bind, ensure_layout
from coordinator.leader import Leadership
from coordinator.metrics import RETENTION_S, decision_latency, registry_for
from coordinator.node_life import PROBATION_S
from coordinator.registry import Registry
from proto import subjects
from proto.codec import encode, node_beat_decoder
from proto.events import CoordinatorLeader, EventBase
from proto.node import CoordinatorRecord
from ringmaster import clock_responder, metrics, systemd_notify
from ringmaster.bus import connect, publish_event
from ringmaster.clock import SYSTEM, Clock
from ringmaster.retry import retrying_async

log = structlog.get_logger()
CANARY_S = 0.5  # the bus counts as out after Registry.bus_outage_s without a canary


class Coordinator:
    def __init__(
        self,
        nats_url: str,
        cluster: str,
        me: str,
        ttl: float = 2.0,
        replicas: int = 1,
        metrics_port: int = metrics.OFF,
        metrics_addr: str = "0.0.0.0",
        metrics_retention_s: float = RETENTION_S,
        alert_url: str = "",
        creds: str | None = None,
        slurm: str = "off",
        clock: Clock = SYSTEM,
        probation: Mapping[str, float] = PROBATION_S,
    ) -> None:
        # what every decision reads the time from: beats' arrivals, the lease, the jobs
        self.clock = clock
        # drain in Slurm what the nodes report (coordinator.slurm_drains): on, off, or auto
        # (whenever Slurm's commands and configuration are there)
        self.slurm = slurm
        self.probation = probation  # s a node's health gate must pass after a drain, by kind
        self.creds = creds  # creds file path (ringmaster.auth); None: no auth
        self.alert_url = alert_url  # the coordinator's own webhook (jobs may add theirs)
        self.alerter: Alerter | None = None
        self.nats_url, self.cluster, self.me, self.ttl = nats_url, cluster, me, ttl
        self.replicas = replicas
        self.metrics_port, self.metrics_addr = metrics_port, metrics_addr
        self.metrics_retention_s = metrics_retention_s
        self.registry = Registry()
        self._leadership: Leadership | None = None
        self._decisions: Histogram | None = None
        self.metrics: metrics.MetricsServer | None = None

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.nats_url, self.me, self.creds)
        lease_nc = await connect(self.nats_url, f"{self.me}-lease", self.creds)
        beats_nc = await connect(self.nats_url, f"{self.me}-heartbeats", self.creds)
        connections = (nc, lease_nc, beats_nc)
        js = nc.jetstream()
        buckets = await self._layout(js, stop)
        lease_buckets = await bind(lease_nc.jetstream(), self.cluster)
        self.js = js
        await presence.answer(lease_nc, self.cluster, self.me)
        election = Election(
            KvCasStore(lease_buckets.leader),
            self.me,
            self.ttl,
            clock=self.clock,
            holder_gone=presence.prober(lease_nc, self.cluster),
        )
        self.election = election
        commander = Commander(nc, self.cluster, self.me, lambda: election.epoch)
        jobs = JobManager(
            KvCasStore(buckets.jobs), commander, self.registry, self.publish, clock=self.clock
        )
        self.alerter = Alerter(
            lambda e: destinations(e, jobs.jobs.values(), self.alert_url), clock=self.clock
        )
        exposition = registry_for(
            self.me, election, self.registry, jobs, self.metrics_retention_s, self.clock
        )
        self._decisions = decision_latency(exposition)
        self.metrics = metrics.serve(
            exposition, self.metrics_port, self.metrics_addr, host=socket.gethostname()
        )

        async def on_beat(msg: Msg) -> None:
            with contextlib.suppress(msgspec.DecodeError):
                beat = node_beat_decoder.decode(msg.data)
                if beat.node == subjects.sender(msg.subject):  # a node speaks for itself only
                    self.registry.observe(beat, self.clock.monotonic())

        async def on_canary(msg: Msg) -> None:
            self.registry.bus_alive(self.clock.monotonic())

        await beats_nc.subscribe(subjects.heartbeats(self.cluster), cb=on_beat)
        await beats_nc.subscribe(subjects.canary(self.cluster, self.me), cb=on_canary)
        canary = asyncio.create_task(self._canary(beats_nc, stop), name="canary")
        # Agents measure their clock offset against the coordinators (NTP-style).
        await clock_responder.serve(lease_nc, self.cluster)
        log.info("coordinator running", id=self.me, cluster=self.cluster)
        try:
            async with systemd_notify.service(f"{self.me} running", self._status):
                await self._elect(stop, nc, js, buckets, jobs, lease_buckets)
        finally:
            canary.cancel()
            await self._unlead()
            await self.alerter.close()
            with contextlib.suppress(Exception):
                await election.release()
            with contextlib.suppress(Exception):
                await lease_buckets.members.delete(self.me)
            if self.metrics is not None:
                self.metrics.close()
            for conn in connections:
                with contextlib.suppress(Exception):
                    # close, not drain: draining waits for pull subscriptions' open fetches
                    await conn.close()

    async def _elect(
        self,
        stop: asyncio.Event,
        nc: Client,
        js: JetStreamContext,
        buckets: Buckets,
        jobs: JobManager,
        lease_buckets: Buckets,
    ) -> None:
        """Election rounds until asked to stop: lead on winning, step down on losing."""
        election = self.election
        while not stop.is_set():
            was = election.role
            try:
                role = await asyncio.wait_for(election.step(), timeout=self.ttl / 2)
            except Exception as exc:
                log.warning("election round failed", error=repr(exc))
                role = election.role
            if role is Role.LEADER and self._leadership is None:
                await self._lead(nc, js, buckets, jobs)
            elif role is not Role.LEADER and was is Role.LEADER:
                log.warning("lost leadership", id=self.me)
                await self._unlead()
            await self._presence(lease_buckets)
            pause = election.renew_every if role is Role.LEADER else 0.2
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=pause)

    async def _canary(self, nc: Client, stop: asyncio.Event) -> None:
        """Publish to ourselves through the server twice a second (see Registry.bus_alive)."""
        subject = subjects.canary(self.cluster, self.me)
        while not stop.is_set():
            with contextlib.suppress(Exception):
                await nc.publish(subject, b"")
            await asyncio.sleep(CANARY_S)

    def _status(self) -> str:
        """systemd's STATUS= line: what ``systemctl status`` shows the on-call engineer."""
        role = self.election.role.value
        nodes = len(self.registry.nodes)
        return f"{role} (epoch {self.election.epoch}), {nodes} nodes known"

    async def _layout(self, js: JetStreamContext, stop: asyncio.Event) -> Buckets:
        """Streams and buckets, retried while JetStream is not ready (a clustered server
        still electing its meta leader, say) until asked to stop."""

        def note(exc: BaseException, wait_s: float) -> None:
            log.warning("JetStream not ready, retrying", error=repr(exc), in_s=round(wait_s, 2))

        return await retrying_async(
            (NatsError, TimeoutError, OSError),
            first_s=0.2,
            cap_s=2.0,
            give_up=stop.is_set,
            note=note,
        )(ensure_layout, js, self.cluster, self.replicas)

    async def publish(self, event: EventBase) -> None:
        # Alerted before the stream has it: a job's end is told even while JetStream is out.
        self._alert(event)
        await publish_event(self.js, self.cluster, event)

    def _alert(self, event: EventBase) -> None:
        """Alerts come from the leader only (a standby sees the same events)."""
        if self._leadership is not None and self.alerter is not None:
            self.alerter.notify(event)

    async def _presence(self, buckets: Buckets) -> None:
        record = CoordinatorRecord(
            id=self.me,
            role=self.election.role.value,
            epoch=self.election.epoch,
            pid=os.getpid(),
            updated_at=self.clock.time(),
            metrics_url=self.metrics.url if self.metrics is not None else "",
        )
        with contextlib.suppress(Exception):
            await buckets.members.put(self.me, encode(record))

    async def _lead(
        self, nc: Client, js: JetStreamContext, buckets: Buckets, jobs: JobManager
    ) -> None:
        """Take over as leader. The take-over reads every job from KV, which fails while
        the bus is still electing stream leaders (a server of a cluster just died): the
        failure is logged and the take-over tried again next round, still holding the
        lease, instead of ending the coordinator."""
        epoch = self.election.epoch
        log.info("leading", id=self.me, epoch=epoch)
        leadership = Leadership(
            nc,
            js,
            self.cluster,
            self.me,
            buckets,
            self.registry,
            jobs,
            self.publish,
            decisions=self._decisions,
            alert=self._alert,
            slurm=self.slurm,
            probation=self.probation,
        )
        try:
            await leadership.start()
        except Exception as exc:
            log.warning("taking over failed; trying again", id=self.me, error=repr(exc))
            await leadership.stop()
            return
        self._leadership = leadership
        try:
            await self.publish(
                CoordinatorLeader(coordinator=self.me, epoch=epoch, message=f"{self.me} leads")
            )
        except Exception as exc:  # the bus is out: leading matters, its announcement less
            log.warning("could not announce the leadership", id=self.me, error=repr(exc))

    async def _unlead(self) -> None:
        if self._leadership is not None:
            await self._leadership.stop()
            self._leadership = None
