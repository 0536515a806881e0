"""A beat its agent built before a launch, held back on the bus and delivered after the
launch was answered, against a real coordinator over a real NATS server: it proves
nothing about the new attempt's ranks, so the job is unharmed (no ``worker.exited``, no
restart). The agent's clock was stepped back between that beat and its answer, as a
resync does, so the beat's own stamp is later than the answer's: only the beat's word on
which launches its agent had carried out tells it apart (``coordinator.reconcile.
knows_launch``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from coordinator.embedded_nats import NatsServer
from coordinator.job_reconcile import Findings, Reconciler
from coordinator.service import Coordinator
from proto import subjects
from proto.api import SubmitJob
from proto.codec import api_reply_decoder, command_decoder, encode
from proto.commands import CommandReply, Launch, ReservePort
from proto.job import JobRecord, JobSection, JobSpec, JobState
from proto.node import Heartbeat, RankReport
from ringmaster.clock import ManualClock
from ringmaster.procs import wait_until_async

pytestmark = pytest.mark.anyio
CLUSTER = "late"
NODES = ("node-0", "node-1")
INTERVAL_S = 60.0  # the test sends every beat itself: no node falls silent meanwhile


class Agents:
    """The agents of ``NODES`` over NATS, as ``nodeagent`` answers and beats: ranks
    registered before the launch is answered, every beat stamped on its node's own clock
    and naming the launches carried out when it was built. node-1 builds a beat as the
    launch reaches it, and holds it; its clock then steps back 5 s before it answers."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.clock = ManualClock()
        self.started_at = self.clock.time()
        self.seq = 0
        self.ranks: dict[str, list[RankReport]] = {}
        self.launched: dict[str, dict[str, int]] = {}
        self.held: Heartbeat | None = None
        self.answered = asyncio.Event()

    def beat(self, node: str) -> Heartbeat:
        self.seq += 1
        ranks = self.ranks.get(node, [])
        return Heartbeat(
            node=node,
            seq=self.seq,
            sent_at=self.clock.time(),
            addr=f"10.0.0.{NODES.index(node) + 1}",
            gpus=1,
            interval_s=INTERVAL_S,
            ranks=tuple(ranks),
            jobs=tuple({r.job for r in ranks}),
            launched=dict(self.launched.get(node, {})),
            started_at=self.started_at,
        )

    async def send(self, beat: Heartbeat) -> None:
        await self.nc.publish(subjects.heartbeat(CLUSTER, beat.node), encode(beat))
        await self.nc.flush()

    async def on_command(self, msg: Msg) -> None:
        node = msg.subject.rsplit(".", 1)[-1]
        cmd = command_decoder.decode(msg.data)
        reply = CommandReply(ok=True, node=node, epoch_seen=cmd.epoch)
        if isinstance(cmd, ReservePort):
            reply.port = 29500
        elif isinstance(cmd, Launch):
            if node == "node-1":
                self.held = self.beat(node)  # built before this launch is carried out
                self.clock.set_wall(self.clock.time() - 5.0)  # a resync steps it back
            reply.pids = [10_000 + r.rank for r in cmd.ranks]
            self.ranks[node] = [
                RankReport(job=cmd.job, rank=r.rank, attempt=cmd.attempt, pid=pid, alive=True)
                for r, pid in zip(cmd.ranks, reply.pids, strict=True)
            ]
            self.launched.setdefault(node, {})[cmd.job] = cmd.attempt
        reply.sent_at, reply.started_at = self.clock.time(), self.started_at
        self.clock.advance(0.01)
        await msg.respond(encode(reply))


@pytest.fixture
async def coordinator(nats_server: NatsServer) -> AsyncIterator[Coordinator]:
    coord = Coordinator(nats_server.url, CLUSTER, "c0", ttl=2.0)
    stop = asyncio.Event()
    running = asyncio.create_task(coord.run(stop))

    async def leading() -> bool:
        assert not running.done(), "the coordinator ended"
        return coord._leadership is not None

    try:
        await wait_until_async(leading, timeout=30)
        yield coord
    finally:
        stop.set()
        await asyncio.wait_for(running, timeout=15)


async def registered_agents(nc: Client, coordinator: Coordinator) -> tuple[Agents, list[bytes]]:
    """The simulated agents answering commands, every node registered with the leader, and
    the ``worker.exited`` events it publishes from then on."""
    agents = Agents(nc)
    exits: list[bytes] = []

    async def on_exit(msg: Msg) -> None:
        exits.append(msg.data)

    await nc.subscribe(subjects.command(CLUSTER, "*"), cb=agents.on_command)
    await nc.subscribe(subjects.events_filter(CLUSTER, kind="worker.exited"), cb=on_exit)
    for node in NODES:
        await agents.send(agents.beat(node))

    async def registered() -> bool:
        return all(n in coordinator.registry.nodes for n in NODES)

    await wait_until_async(registered, timeout=30)
    return agents, exits


async def test_a_beat_built_before_the_launch_and_delivered_after_it_harms_nothing(
    nats_server: NatsServer, coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks: list[None] = []
    reconcile = Reconciler.reconcile

    async def counted(self: Reconciler, jobs: Mapping[str, JobRecord], out: Findings) -> None:
        await reconcile(self, jobs, out)
        ticks.append(None)

    monkeypatch.setattr(Reconciler, "reconcile", counted)

    async def ticked(n: int) -> None:
        """Until the leader has reconciled ``n`` more times."""
        goal = len(ticks) + n

        async def done() -> bool:
            return len(ticks) >= goal

        await wait_until_async(done, timeout=30)

    nc = await nats.connect(nats_server.url)
    try:
        agents, exits = await registered_agents(nc, coordinator)
        registry = coordinator.registry
        spec = JobSpec(job=JobSection(name="late", nodes=2))
        msg = await nc.request(
            subjects.api(CLUSTER, "submit"), encode(SubmitJob(spec=spec, workdir="/w")), 10
        )
        job_id = api_reply_decoder.decode(msg.data).job
        assert coordinator._leadership is not None
        manager = coordinator._leadership.jobs

        async def answered() -> bool:
            launch = manager.launcher.launched_at.get(job_id)
            return launch is not None and launch[1] != float("inf")

        await wait_until_async(answered, timeout=30)
        held = agents.held
        assert held is not None and not held.ranks
        assert held.sent_at > manager.launcher.answered_at[job_id]["node-1"]  # fools clocks

        await agents.send(held)  # delivered after the launch, however late

        async def read() -> bool:
            return registry.nodes["node-1"].beat_sent_at == held.sent_at

        await wait_until_async(read, timeout=30)
        await ticked(4)  # a second of ticks with it as node-1's newest beat
        job = manager.jobs[job_id]
        assert (job.attempt, job.restarts, exits) == (1, 0, []), job.reason
        assert job.state is JobState.STARTING

        for node in NODES:  # beats built after the launch list its ranks
            await agents.send(agents.beat(node))

        async def current() -> bool:
            return registry.nodes["node-1"].launched == {job_id: 1}

        await wait_until_async(current, timeout=30)
        await ticked(2)
        assert (job.attempt, job.restarts, exits) == (1, 0, []), job.reason
    finally:
        await nc.close()


async def test_a_missing_rank_is_still_found_from_a_beat_built_after_the_launch(
    nats_server: NatsServer, coordinator: Coordinator
) -> None:
    """The same agents, but node-1's rank is gone from a beat that names the launch: that
    is evidence, and the leader reconciles the exit."""
    nc = await nats.connect(nats_server.url)
    try:
        agents, exits = await registered_agents(nc, coordinator)
        spec = JobSpec(job=JobSection(name="late", nodes=2))
        await nc.request(
            subjects.api(CLUSTER, "submit"), encode(SubmitJob(spec=spec, workdir="/w")), 10
        )

        async def launched() -> bool:
            return "node-1" in agents.launched

        await wait_until_async(launched, timeout=30)
        agents.ranks["node-1"] = []  # rank 1 died and its agent forgot it
        await agents.send(agents.beat("node-1"))

        async def reconciled() -> bool:
            return bool(exits)

        await wait_until_async(reconciled, timeout=30)
        assert b"its agent reports no such rank" in exits[0]
    finally:
        await nc.close()
