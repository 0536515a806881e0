"""Ordered, acknowledged publishing that survives a NATS outage or a missing stream.

Events and progress go through JetStream and wait for the ack; when the publish fails
(server restarting, stream not yet created by a coordinator) the message is retried in
order, with the shared jittered backoff (:mod:`ringmaster.retry`: every agent's publish
fails at once when the bus restarts, and they must not all come back at once). The queue
is bounded: past ``limit`` the oldest message is dropped and logged.

Each message carries a ``Nats-Msg-Id`` unique to this outbox: a publish whose ack was
late (a loaded server answers after the timeout) is retried, and the stream's duplicate
window then stores it once, so the history never shows one rank exiting twice.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import deque

import structlog
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from ringmaster.retry import retrying_async

log = structlog.get_logger()


class Outbox:
    def __init__(self, js: JetStreamContext, limit: int = 10_000) -> None:
        self._js = js
        self._queue: deque[tuple[str, bytes, str]] = deque()
        self._origin = uuid.uuid4().hex
        self._serial = itertools.count()
        self._limit = limit
        self._ready = asyncio.Event()
        self.dropped = 0

    def put(self, subject: str, payload: bytes) -> None:
        if len(self._queue) >= self._limit:
            self._queue.popleft()
            self.dropped += 1
            log.warning("outbox full, dropped oldest message", dropped=self.dropped)
        self._queue.append((subject, payload, f"{self._origin}-{next(self._serial)}"))
        self._ready.set()

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            while self._queue:
                head = self._queue[0]
                await self._publish(*head)
                if self._queue and self._queue[0] is head:  # not dropped meanwhile by put()
                    self._queue.popleft()
            self._ready.clear()

    async def _publish(self, subject: str, payload: bytes, msg_id: str) -> None:
        def note(exc: BaseException, wait_s: float) -> None:
            log.debug("publish failed, will retry", subject=subject, error=repr(exc))

        await retrying_async((NatsError, TimeoutError), first_s=0.1, cap_s=2.0, note=note)(
            self._js.publish, subject, payload, timeout=2, headers={"Nats-Msg-Id": msg_id}
        )

    async def drain(self, timeout: float) -> None:
        """Give queued messages a bounded chance to go out (shutdown)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._queue and loop.time() < deadline:
            await asyncio.sleep(0.05)
