"""Node agents as the job manager sees them, in memory: a :class:`CommandSender` that
answers commands the way real agents do (fencing by epoch, a port for the master, pids
for a launch) and records what it was told, and the heartbeat each would send now (the
ranks it launched, and the attempts whose launch it carried out, as a real agent's beat
built after its answer says them). Shipped beside the real sender so the job lifecycle is
tested without a NATS server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from proto.commands import CommandBase, CommandReply, Launch, ReservePort
from proto.node import Heartbeat, RankReport
from ringmaster.clock import SYSTEM, Clock


@dataclass
class FakeAgents:
    """Every node's agent. ``down`` nodes do not answer; ``failing`` ones answer errors;
    a launch on a node in ``slow`` is answered once ``go`` is set (a node whose ranks take
    long to start). ``clock``: the nodes' own, which stamps their replies."""

    port: int = 29500
    epoch_seen: dict[str, int] = field(default_factory=dict)
    received: list[tuple[str, CommandBase]] = field(default_factory=list)
    refused: list[tuple[str, CommandBase]] = field(default_factory=list)
    down: set[str] = field(default_factory=set)
    failing: dict[str, str] = field(default_factory=dict)
    slow: set[str] = field(default_factory=set)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    clock: Clock = SYSTEM
    started_at: float = 1.0  # when every agent process started (their beats' started_at)
    # node → job → the attempt launched there, and its ranks (alive), as its agent says
    launched: dict[str, dict[str, int]] = field(default_factory=dict)
    ranks: dict[str, dict[str, list[RankReport]]] = field(default_factory=dict)

    def sender(self, me: str, epoch: Callable[[], int]) -> FakeSender:
        """The command channel of a coordinator called ``me`` leading at ``epoch()``."""
        return FakeSender(self, me, epoch)

    def handle(self, node: str, cmd: CommandBase) -> CommandReply:
        if node in self.down:
            return CommandReply(
                ok=False, node=node, error=f"node {node} did not answer in time", answered=False
            )
        seen = self.epoch_seen.get(node, 0)
        if cmd.epoch < seen:
            self.refused.append((node, cmd))
            return CommandReply(
                ok=False, node=node, epoch_seen=seen, error=f"stale epoch {cmd.epoch} < {seen}"
            )
        self.epoch_seen[node] = cmd.epoch
        self.received.append((node, cmd))
        if node in self.failing:
            return CommandReply(ok=False, node=node, epoch_seen=cmd.epoch, error=self.failing[node])
        reply = CommandReply(
            ok=True,
            node=node,
            epoch_seen=cmd.epoch,
            sent_at=self.clock.time(),
            started_at=self.started_at,
        )
        if isinstance(cmd, ReservePort):
            reply.port = self.port
        elif isinstance(cmd, Launch):
            reply.pids = [10_000 + r.rank for r in cmd.ranks]
            self.ranks.setdefault(node, {})[cmd.job] = [
                RankReport(job=cmd.job, rank=r.rank, attempt=cmd.attempt, pid=pid, alive=True)
                for r, pid in zip(cmd.ranks, reply.pids, strict=True)
            ]
            self.launched.setdefault(node, {})[cmd.job] = cmd.attempt
        return reply

    def heartbeat(self, node: str, seq: int, sent_at: float, addr: str = "") -> Heartbeat:
        """The beat ``node``'s agent builds now: the ranks it launched, alive, and per job
        the attempt it launched (every answer it gave is older than this beat)."""
        ranks = [r for reports in self.ranks.get(node, {}).values() for r in reports]
        return Heartbeat(
            node=node,
            seq=seq,
            sent_at=sent_at,
            addr=addr,
            gpus=1,
            ranks=tuple(ranks),
            jobs=tuple(self.ranks.get(node, {})),
            launched=dict(self.launched.get(node, {})),
            started_at=self.started_at,
        )

    def commands(self, kind: type[CommandBase], node: str | None = None) -> list[CommandBase]:
        """What the agents accepted, of one command type (and on one node)."""
        return [c for n, c in self.received if isinstance(c, kind) and node in (None, n)]


@dataclass
class FakeSender:
    agents: FakeAgents
    me: str
    epoch: Callable[[], int]

    async def send(self, node: str, cmd: CommandBase, timeout: float = 10.0) -> CommandReply:
        cmd.epoch, cmd.issued_by = self.epoch(), self.me
        await asyncio.sleep(0)  # a real request yields to the loop
        if isinstance(cmd, Launch) and node in self.agents.slow:
            await self.agents.go.wait()
        return self.agents.handle(node, cmd)

    async def send_all(
        self, nodes: list[str], make: Callable[[], CommandBase], timeout: float = 10.0
    ) -> dict[str, CommandReply]:
        return {node: await self.send(node, make(), timeout) for node in nodes}
