"""The agent's outbox against a JetStream stand-in that fails: messages go out in order
once publishing works again, and only bus failures are retried."""

from __future__ import annotations

import asyncio
from typing import cast

import nats
import pytest
from nats.errors import NoServersError
from nats.js import JetStreamContext
from nats.js.api import PubAck

from coordinator.embedded_nats import NatsServer
from coordinator.kvstore import ensure_layout
from nodeagent.outbox import Outbox
from proto import subjects
from ringmaster.procs import wait_until_async

pytestmark = pytest.mark.anyio


class Bus:
    """``publish`` raises ``failures`` in turn, and while ``down``; else records what it
    was given."""

    def __init__(self, *failures: BaseException) -> None:
        self.failures, self.tries, self.sent = list(failures), 0, list[bytes]()
        self.down = False

    async def publish(
        self, subject: str, payload: bytes, timeout: float, headers: dict[str, str]
    ) -> None:
        self.tries += 1
        if self.failures:
            raise self.failures.pop(0)
        if self.down:
            raise NoServersError
        self.sent.append(payload)


async def run(bus: Bus, *payloads: bytes) -> tuple[Outbox, asyncio.Task[None]]:
    outbox = Outbox(cast(JetStreamContext, bus))
    for payload in payloads:
        outbox.put("s", payload)
    return outbox, asyncio.create_task(outbox.run())


async def test_a_bus_outage_is_retried_and_order_kept() -> None:
    bus = Bus(NoServersError(), TimeoutError(), NoServersError())
    _, task = await run(bus, b"1", b"2", b"3")
    try:

        async def all_sent() -> bool:
            return len(bus.sent) == 3

        await wait_until_async(all_sent, timeout=10)
        assert bus.sent == [b"1", b"2", b"3"] and bus.tries == 6
    finally:
        task.cancel()


async def test_anything_but_a_bus_failure_is_not_retried() -> None:
    bus = Bus(ValueError("a bug"))
    _, task = await run(bus, b"1")
    with pytest.raises(ValueError, match="a bug"):
        await asyncio.wait_for(task, timeout=10)
    assert bus.tries == 1


async def test_a_message_dropped_while_it_is_retried_does_not_take_the_next_with_it() -> None:
    bus = Bus()
    bus.down = True
    outbox, task = await run(bus, b"old")
    outbox._limit = 1  # full: the next put drops b"old", which is being retried
    try:

        async def tried() -> bool:
            return bus.tries >= 1

        await wait_until_async(tried, timeout=10)
        outbox.put("s", b"new")
        bus.down = False

        async def new_sent() -> bool:
            return b"new" in bus.sent

        await wait_until_async(new_sent, timeout=10)
        assert outbox.dropped == 1 and b"new" in bus.sent
    finally:
        task.cancel()


class LateAck:
    """A real JetStream whose first ack comes too late: the message is stored, and the
    publisher sees a timeout (a loaded server answering after the publish timeout)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js, self.tries = js, 0

    async def publish(
        self, subject: str, payload: bytes, timeout: float, headers: dict[str, str]
    ) -> PubAck:
        self.tries += 1
        ack = await self.js.publish(subject, payload, timeout=timeout, headers=headers)
        if self.tries == 1:
            raise TimeoutError
        return ack


async def test_a_late_ack_is_retried_and_the_stream_stores_the_message_once(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await ensure_layout(js, "dup")
        bus = LateAck(js)
        outbox = Outbox(cast(JetStreamContext, bus))
        subject = subjects.event("dup", "node", "node-0", "worker.exited")
        outbox.put(subject, b"exit")
        outbox.put(subject, b"exit")  # the same bytes twice are two messages
        task = asyncio.create_task(outbox.run())
        try:

            async def drained() -> bool:
                return bus.tries >= 3 and not outbox._queue

            await wait_until_async(drained, timeout=10)
        finally:
            task.cancel()
        info = await js.stream_info(subjects.events_stream("dup"))
        assert info.state.messages == 2
    finally:
        await nc.close()
