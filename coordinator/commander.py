"""Sending commands to node agents: stamped with the leader's epoch, request/reply (a
publish alone is no delivery guarantee), every failure turned into a reply."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError

from proto import subjects
from proto.codec import encode, reply_decoder
from proto.commands import CommandBase, CommandReply


class CommandSender(Protocol):
    """What the job manager needs to give orders: :class:`Commander` over NATS, or
    :class:`coordinator.fake_agents.FakeAgents`' sender in tests."""

    async def send(self, node: str, cmd: CommandBase, timeout: float = 10.0) -> CommandReply: ...

    async def send_all(
        self, nodes: list[str], make: Callable[[], CommandBase], timeout: float = 10.0
    ) -> dict[str, CommandReply]: ...


class Commander:
    def __init__(self, nc: Client, cluster: str, me: str, epoch: Callable[[], int]) -> None:
        self.nc = nc
        self.cluster = cluster
        self.me = me
        self.epoch = epoch

    async def send(self, node: str, cmd: CommandBase, timeout: float = 10.0) -> CommandReply:
        cmd.epoch = self.epoch()
        cmd.issued_by = self.me
        try:
            msg = await self.nc.request(
                subjects.command(self.cluster, node), encode(cmd), timeout=timeout
            )
        except TimeoutError:
            return CommandReply(
                ok=False, node=node, error=f"node {node} did not answer in time", answered=False
            )
        except NatsError as exc:
            return CommandReply(ok=False, node=node, error=f"node {node}: {exc}", answered=False)
        try:
            return reply_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            return CommandReply(ok=False, node=node, error=f"node {node} sent a bad reply: {exc}")

    async def send_all(
        self, nodes: list[str], make: Callable[[], CommandBase], timeout: float = 10.0
    ) -> dict[str, CommandReply]:
        replies = await asyncio.gather(*(self.send(n, make(), timeout) for n in nodes))
        return dict(zip(nodes, replies, strict=True))
