"""The leader's pull consumer (coordinator.pull) against a real nats-server: a message is
handed over the moment it arrives, whichever of the consumer's pull requests brought it,
and a status ends only the request it names.

The failure this guards against: nats-py's ``fetch`` read the late 408 of a request it had
already given up on as the end of its next one, sent a second, lingering request for a
batch of 100, and the next event went to that orphan and waited for it to expire. Every
request here lives a minute, so an event held back by any request would fail the bounded
waits; nothing waits for time to pass."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from coordinator import pull
from coordinator.embedded_nats import NatsServer
from ringmaster.procs import wait_until_async
from tests.waits import until_async

pytestmark = pytest.mark.anyio
STREAM, CONSUMER = "EVENTS", "leader"
LONG_S = 60.0  # no pull request of a test ends by itself
WAIT_S = 30.0


@dataclass
class Bus:
    nc: Client  # the consumer's
    other: Client  # the publishers' and the spy's
    js: JetStreamContext
    handled: list[bytes] = field(default_factory=list)

    async def handle(self, msg: Msg) -> None:
        self.handled.append(msg.data)
        await msg.ack()

    async def end(self, reply: str, status: str = "408", said: str = "Request Timeout") -> None:
        """What the server sends when a pull request ends, sent to ``reply``."""
        await self.other.publish(reply, b"", headers={"Status": status, "Description": said})
        await self.other.flush()

    async def arrived(self, data: bytes) -> None:
        async def seen() -> bool:
            return data in self.handled

        await wait_until_async(seen, WAIT_S, interval=0.01)


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    nc = await nats.connect(nats_server.url)
    other = await nats.connect(nats_server.url)
    js = other.jetstream()
    await js.add_stream(name=STREAM, subjects=["ev.>"])
    config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=1000)
    await pull.durable(nc.jetstream(), STREAM, CONSUMER, config)
    bus = Bus(nc, other, js)
    try:
        yield bus
    finally:
        await nc.close()
        await other.close()


async def running(bus: Bus) -> tuple[pull.Puller, asyncio.Task[None]]:
    puller = pull.Puller(bus.nc, STREAM, CONSUMER, expires_s=LONG_S, grace_s=LONG_S)
    return puller, asyncio.create_task(puller.run(bus.handle))


async def sent(puller: pull.Puller, count: int) -> str:
    """The reply subject of the consumer's ``count``-th pull request, once it is sent (the
    server's own answers, not a spy, show that it arrived: a client subscribed to the
    JetStream API's subject does not see every request)."""

    def there() -> bool:
        return puller.requests >= count

    await until_async(there, WAIT_S, f"pull request {count}", lambda: puller.requests)
    assert puller.requests == count  # no request ends while a test has not ended it
    return puller.reply


async def stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_message_is_handed_over_while_its_request_is_still_open(bus: Bus) -> None:
    puller, task = await running(bus)
    await sent(puller, 1)
    assert puller.body == b'{"batch": 100, "expires": 60000000000}'  # lingers, never no_wait
    for i in range(3):
        await bus.js.publish("ev.x", b"event %d" % i)
        await bus.arrived(b"event %d" % i)  # not after the rest of a batch of 100
    assert puller.requests == 1  # the same request brought all
    await stopped(task)


async def test_a_late_end_of_an_earlier_request_ends_nothing(bus: Bus) -> None:
    puller, task = await running(bus)
    first = await sent(puller, 1)
    await bus.end(first)  # its end, as the server says it
    second = await sent(puller, 2)
    assert first != second  # each request has a reply subject of its own
    await bus.end(first)  # the first's end again, late: the second is still open
    await bus.js.publish("ev.x", b"after")  # reaches the consumer after that late 408
    await bus.arrived(b"after")
    assert puller.requests == 2
    await stopped(task)


async def test_what_a_request_given_up_on_brings_is_handled_at_once(bus: Bus) -> None:
    """The server still holds the first request, which the consumer took as ended: the
    messages go to it (the oldest), and are handled all the same, not held for its end."""
    puller, task = await running(bus)
    await bus.end(await sent(puller, 1))
    await sent(puller, 2)
    for i in range(3):
        await bus.js.publish("ev.x", b"event %d" % i)
        await bus.arrived(b"event %d" % i)
    assert puller.requests == 2
    await stopped(task)


async def test_a_request_the_server_refuses_ends_the_run(bus: Bus) -> None:
    puller, task = await running(bus)
    await bus.end(await sent(puller, 1), "409", "Consumer Deleted")
    with pytest.raises(pull.PullRefused, match="409 Consumer Deleted"):
        await task
    assert puller.requests == 1


async def test_durable_keeps_a_consumer_that_is_there(bus: Bus) -> None:
    """A new leader resumes where the last one acked: the consumer is not made again."""
    await bus.js.publish("ev.x", b"handled before")
    _, task = await running(bus)
    await bus.arrived(b"handled before")
    await stopped(task)
    # the stopped puller's subscription is gone from the server before the next event
    # (else the server hands the event to its still-open request, and it comes back only
    # after the ack wait)
    await bus.nc.flush()
    await bus.js.publish("ev.x", b"left for the next leader")
    config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=1000)
    await pull.durable(bus.nc.jetstream(), STREAM, CONSUMER, config)
    bus.handled.clear()
    _, task = await running(bus)
    await bus.arrived(b"left for the next leader")
    assert bus.handled == [b"left for the next leader"]
    await stopped(task)
