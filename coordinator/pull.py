"""A durable pull consumer's messages, each handled as soon as it arrives: how the leader
takes its events and rank 0's progress.

Not nats-py's ``PullSubscription.fetch``. Its pull requests all share one reply subject,
so the end of a request (the server's 408 when it expires) that arrives after the
client's own timer gave up on it is read by the next fetch as the end of its own request.
That fetch then sends a second, lingering request, which outlives it: the next message
goes to that orphan, and the fetch that receives it waits for the rest of a batch of 100
until the orphan expires, up to its full second. A coordinator busy with 10,000 nodes'
beats misses the server's 408 by its 100 µs margin at most idle seconds, and the first
event after a quiet spell waited up to half a second for its decision that way.

Here every pull request has a reply subject of its own: a status ends only the request it
names (a late one ends nothing), and a message is handed over the moment it arrives,
whichever request brought it, without waiting for the rest of a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import DEFAULT_PREFIX, ConsumerConfig
from nats.js.errors import NotFoundError

BATCH = 100  # messages one pull request asks for
EXPIRES_S = 1.0  # a pull request's life on the server; it ends with a 408 then
GRACE_S = 1.0  # a request whose end has not come this long after it expired is given up

Handler = Callable[[Msg], Awaitable[None]]


class PullRefused(Exception):
    """JetStream ended a pull request with a status other than "no messages" or "request
    timeout" (the consumer was deleted, its stream's leader changed, the request was bad)."""


async def durable(js: JetStreamContext, stream: str, name: str, config: ConsumerConfig) -> None:
    """The durable consumer ``name`` on ``stream``, created with ``config`` if missing (an
    existing one is kept as it is, so a new leader resumes where the last one acked)."""
    try:
        await js.consumer_info(stream, name)
    except NotFoundError:
        await js.add_consumer(stream, config=config.evolve(name=name, durable_name=name))


class Puller:
    """Pull requests to one durable consumer, one at a time, each asking for up to
    ``batch`` messages for ``expires_s``; the next is sent when the server has ended the
    last (a 404 or 408 on its own reply subject), when it brought its whole batch, or
    ``grace_s`` after it expired if its end never came (a server restarted meanwhile)."""

    def __init__(
        self,
        nc: Client,
        stream: str,
        consumer: str,
        batch: int = BATCH,
        expires_s: float = EXPIRES_S,
        grace_s: float = GRACE_S,
    ) -> None:
        self.nc, self.stream, self.consumer = nc, stream, consumer
        self.batch, self.expires_s, self.grace_s = batch, expires_s, grace_s
        self.subject = f"{DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.requests = 0  # pull requests sent so far
        self.reply, self.body = "", b""  # the latest one's reply subject and body

    async def run(self, handle: Handler) -> None:
        """Hand every message to ``handle``, in the order they arrive, until cancelled.
        ``handle`` acks (or not) and its exceptions end the run."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(f"{inbox}.*")
        try:
            while True:
                await self._request(sub, f"{inbox}.{self.requests + 1}", handle)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _request(self, sub: Subscription, reply: str, handle: Handler) -> None:
        """One pull request, from sending it to its end."""
        self.requests += 1
        body = {"batch": self.batch, "expires": int(self.expires_s * 1e9)}
        self.reply, self.body = reply, json.dumps(body).encode()
        await self.nc.publish(self.subject, self.body, reply=reply)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.expires_s + self.grace_s
        left = self.batch
        while left > 0:
            wait = give_up - loop.time()
            if wait <= 0:
                return
            try:
                msg = await sub.next_msg(timeout=wait)
            except (NatsTimeout, TimeoutError):
                return
            status = msg.headers.get("Status") if msg.headers else None
            if status is None:  # a message of the stream
                left -= 1
                await handle(msg)
            elif msg.subject != reply or status == "100":
                continue  # an earlier request's late end, or a heartbeat: nothing ends now
            elif status in ("404", "408"):
                return
            else:
                said = (msg.headers or {}).get("Description", "")
                raise PullRefused(f"{self.stream}/{self.consumer}: {status} {said}".strip())
