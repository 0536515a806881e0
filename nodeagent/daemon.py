"""The node agent: collectors → detectors → events; heartbeats; commands → supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from nodeagent import memory_sweep
from nodeagent.collectors.base import BusAttached, Sample
from nodeagent.commands import CommandHandler
from nodeagent.config import AgentConfig, collective_env, detect_addr, resolve_data_interface
from nodeagent.detectors.base import Unannounced
from nodeagent.hangwatch_loop import HangWatch
from nodeagent.metrics import registry_for
from nodeagent.outbox import Outbox
from nodeagent.peer_probe import PeerProber, ProbeListener, listen
from nodeagent.registry import Registered, build, clock_of
from nodeagent.sampling import ActiveConditions, close_all, pause, run_once_async, summarize
from nodeagent.shutdown import host_shutting_down
from nodeagent.supervisor import Supervisor
from proto import subjects
from proto.codec import decode_event, encode
from proto.conditions import Condition, ConditionKind
from proto.events import (
    CoordinatorLeader,
    EventBase,
    NodeRegistered,
    Severity,
    SpotNotice,
)
from proto.node import CollectorStatus, Heartbeat, Telemetry
from proto.progress import Progress
from ringmaster import auth, metrics, rundir, systemd_notify
from ringmaster.bus import connect, event_subject
from ringmaster.clock import SYSTEM, Clock

log = structlog.get_logger()


class Agent:
    """``clock``: the one clock the agent's decisions read (samples' stamps, the hang
    watch, the peer probes, the sweep, notices' deadlines); the system's in production."""

    def __init__(self, config: AgentConfig, clock: Clock = SYSTEM) -> None:
        self.config = config
        self.clock = clock
        self.node = config.node
        self.run_dir = Path(config.run_dir)
        self.addr = config.advertise_addr or detect_addr(config.nats)
        self.telemetry = Telemetry()
        self.active = ActiveConditions()
        self.statuses: dict[str, CollectorStatus] = {}
        self.latest: dict[str, Sample] = {}  # each collector's newest sample, for /metrics
        self.beats_sent = 0
        self.started_at = clock.time()  # in every heartbeat: a new value is a restarted agent
        self.metrics: metrics.MetricsServer | None = None
        self.registered: list[Registered[Any]] = build(config, clock)
        self._outbox: Outbox | None = None
        self.probe_port = 0  # the peer-probe listener's, once it listens
        self.supervisor = Supervisor(
            self.node,
            self.run_dir,
            self.emit,
            self._progress,
            simulated=config.simulated,
            warm_refill_delay_s=config.warm_refill_delay_s,
            warm_template=Path(config.warm_template_socket)
            if config.warm_template_socket
            else None,
            rank_defaults=collective_env(resolve_data_interface(config.network, config.roots())),
        )

    async def emit(self, event: EventBase) -> None:
        self._publish(event)

    def _publish(self, event: EventBase) -> None:
        self.active.observe(event)
        if self._outbox is None:
            return
        if event.node is None:
            event.node = self.node
        self._outbox.put(event_subject(self.config.cluster, event), encode(event))

    def on_sigterm(self, stop: asyncio.Event) -> None:
        """SIGTERM: the host is shutting the agent down (a spot reclaim's shutdown, a
        drain); announce the node going away before stopping, when so configured."""
        pre = self.config.preemption
        announce = pre.sigterm_notice == "always" or (
            pre.sigterm_notice == "shutdown" and host_shutting_down()
        )
        if announce:
            now = datetime.fromtimestamp(self.clock.time(), UTC)
            deadline = now + timedelta(seconds=pre.sigterm_deadline_s)
            message = f"agent got SIGTERM: node going away by {deadline:%H:%M:%S} UTC"
            self._publish(
                SpotNotice(
                    severity=Severity.CRITICAL,
                    provider="sigterm",
                    action="terminate",
                    deadline=deadline,
                    message=message,
                    condition=Condition(
                        kind=ConditionKind.PREEMPTION,
                        node=self.node,
                        subject="sigterm",
                        severity=Severity.CRITICAL,
                        reason=message,
                    ),
                )
            )
        stop.set()

    async def _progress(self, job: str, message: Progress) -> None:
        if self._outbox is not None:
            message.job = job
            self._outbox.put(
                subjects.progress(self.config.cluster, job, self.node), encode(message)
            )

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        await self.supervisor.warm.adopt()  # spares a predecessor left: none to start for them
        self.supervisor.warm_ranks(self._warm_ranks())  # imports while we connect
        nc = await connect(cfg.nats, f"nodeagent-{self.node}", auth.from_env(cfg.creds_file))
        self._outbox = Outbox(nc.jetstream())
        await self.supervisor.adopt()  # ranks a predecessor started; their exits are events
        self.metrics = metrics.serve(
            registry_for(self), cfg.metrics_port, cfg.metrics_addr, host=self.addr
        )
        if self.metrics is not None:  # a port chosen at start: the health gate reads it here
            rundir.metrics_url(self.run_dir).write_text(self.metrics.url)
        listener: ProbeListener | None = None
        try:
            record = rundir.probe_port(self.run_dir)
            listener, self.probe_port = await listen(self.addr, cfg.network.probe_port, record)
        except OSError as exc:  # peers then cannot probe this node: their word, not a fault
            log.warning("peer probe listener not started", addr=self.addr, error=str(exc))
        clock = clock_of(self.registered)
        handler = CommandHandler(
            self.node,
            self.run_dir,
            self.supervisor,
            self.addr,
            self.emit,
            resync=clock.resync if clock else None,
            started_at=self.started_at,
        )

        async def on_command(msg: Msg) -> None:
            reply = await handler.handle(msg.data)
            if msg.reply:
                await msg.respond(encode(reply))

        async def on_leader(msg: Msg) -> None:
            # A new leader's announcement raises the fence before its first command:
            # from here on, the deposed leader's epoch is refused.
            with contextlib.suppress(msgspec.DecodeError):
                event = decode_event(msg.data)
                if isinstance(event, CoordinatorLeader):
                    handler.observe_epoch(event.epoch)

        await nc.subscribe(subjects.command(cfg.cluster, self.node), cb=on_command)
        await nc.subscribe(
            subjects.event(cfg.cluster, "cluster", "-", "coordinator.leader"), cb=on_leader
        )
        await self.emit(
            NodeRegistered(
                addr=self.addr,
                hostname=socket.gethostname(),
                gpus=self._gpus(),
                simulated=cfg.simulated,
                message=f"agent up at {self.addr}",
            )
        )
        tasks = [asyncio.create_task(self._outbox.run(), name="outbox")]
        tasks += [asyncio.create_task(self._sample_loop(e)) for e in self.registered]
        tasks += [
            asyncio.create_task(e.collector.attach(nc, cfg.cluster))
            for e in self.registered
            if isinstance(e.collector, BusAttached)
        ]
        tasks.append(asyncio.create_task(self._heartbeat_loop(nc)))
        watch = HangWatch(
            self.supervisor, self.emit, self.node, interval_s=cfg.hang_check_s, clock=self.clock
        )
        tasks.append(asyncio.create_task(watch.run(), name="hangwatch"))
        sweeper = memory_sweep.run(self.supervisor.shm, self.node, self.supervisor.jobs, self.clock)
        tasks.append(asyncio.create_task(sweeper, name="memory-sweep"))
        net = cfg.network
        prober = PeerProber(
            self.node,
            self.supervisor.peers,
            self.emit,
            every_s=net.probe_every_s,
            timeout_s=net.probe_timeout_s,
            confirm=net.probe_confirm,
            clock=self.clock,
            restart_grace_s=net.probe_restart_grace_s,
        )
        tasks.append(asyncio.create_task(prober.run(), name="peer-probe"))
        log.info("agent running", node=self.node, addr=self.addr, nats=cfg.nats)
        try:
            async with systemd_notify.service(f"{self.node} up at {self.addr}", self._status):
                await stop.wait()
        finally:
            log.info("agent stopping", node=self.node)
            await self._outbox.drain(2.0)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            close_all(self.registered)
            if self.metrics is not None:
                self.metrics.close()
            await self.supervisor.close()
            if listener is not None:
                await listener.close()
            with contextlib.suppress(Exception):
                await nc.drain()

    def _status(self) -> str:
        """systemd's STATUS= line: how many collectors read, which conditions are open."""
        ok = sum(s.ok for s in self.statuses.values())
        keys = ", ".join(c.key for c in self.active.conditions()) or "none"
        return f"{ok}/{len(self.statuses)} collectors ok; conditions: {keys}"

    def _gpus(self) -> int:
        return self.config.gpus if self.config.gpus is not None else len(self.telemetry.gpus)

    def _probe_confirm_s(self) -> float:
        """The longest a peer unreachable from now may take to open ``net.peer`` here: the
        wait for the next probe, then ``probe_confirm`` failed ones (0: none probe)."""
        net = self.config.network
        if not self.probe_port:
            return 0.0
        return net.probe_every_s * net.probe_confirm + net.probe_timeout_s

    def _warm_ranks(self) -> int:
        return self.config.warm_spares(self._gpus())  # NVML's count once sampled

    async def _sample_loop(self, entry: Registered[Any]) -> None:
        interval = entry.collector.interval_s
        while True:
            started = self.clock.monotonic()
            sample, status = await run_once_async(entry, self.clock.time())
            self.statuses[status.name] = status
            if sample is not None:
                self.latest[status.name] = sample
                summarize(self.telemetry, sample)
                for detector in entry.detectors:
                    for event in detector.observe(sample):
                        log.info("event", kind=type(event).__struct_config__.tag, msg=event.message)
                        await self.emit(event)
                    if isinstance(detector, Unannounced):
                        for condition in detector.unannounced():
                            log.info("condition closed", key=condition.key, msg=condition.reason)
                            self.active.apply(condition)
            took = self.clock.monotonic() - started
            await pause(entry.collector, max(0.0, interval - took))

    async def _heartbeat_loop(self, nc: Client) -> None:
        seq = 0
        subject = subjects.heartbeat(self.config.cluster, self.node)
        while True:
            seq += 1
            beat = Heartbeat(
                node=self.node,
                seq=seq,
                sent_at=self.clock.time(),
                addr=self.addr,
                hostname=socket.gethostname(),
                gpus=self._gpus(),
                cpus=0 if self.config.simulated else (os.cpu_count() or 0),
                simulated=self.config.simulated,
                interval_s=self.config.heartbeat_s,
                probe_port=self.probe_port,
                probe_confirm_s=self._probe_confirm_s(),
                telemetry=self.telemetry,
                conditions=tuple(self.active.conditions()),
                collectors=tuple(self.statuses.values()),
                jobs=tuple(self.supervisor.jobs()),
                metrics_url=self.metrics.url if self.metrics is not None else "",
                ranks=tuple(self.supervisor.rank_reports()),
                launched=self.supervisor.launched(),  # of the same moment as the ranks
                started_at=self.started_at,
            )
            with contextlib.suppress(Exception):
                await nc.publish(subject, encode(beat))
                self.beats_sent += 1
            self.supervisor.warm_ranks(self._warm_ranks())  # NVML's GPU count comes late
            await asyncio.sleep(self.config.heartbeat_s)
