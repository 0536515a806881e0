"""Ordered, acknowledged publishing that survives a NATS outage or a missing stream.

Events and progress go through JetStream and wait for the ack; when the publish fails
(server restarting, stream not yet created by a coordinator) the message is retried in
order. The queue is bounded: past ``limit`` the oldest message is dropped and logged.
"""

from __future__ import annotations

import asyncio
from collections import deque

import structlog
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

log = structlog.get_logger()


class Outbox:
    def __init__(self, js: JetStreamContext, limit: int = 10_000) -> None:
        self._js = js
        self._queue: deque[tuple[str, bytes]] = deque()
        self._limit = limit
        self._ready = asyncio.Event()
        self.dropped = 0

    def put(self, subject: str, payload: bytes) -> None:
        if len(self._queue) >= self._limit:
            self._queue.popleft()
            self.dropped += 1
            log.warning("outbox full, dropped oldest message", dropped=self.dropped)
        self._queue.append((subject, payload))
        self._ready.set()

    async def run(self) -> None:
        delay = 0.1
        while True:
            await self._ready.wait()
            while self._queue:
                subject, payload = self._queue[0]
                try:
                    await self._js.publish(subject, payload, timeout=2)
                except (NatsError, TimeoutError) as exc:
                    log.debug("publish failed, will retry", subject=subject, error=repr(exc))
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                delay = 0.1
                self._queue.popleft()
            self._ready.clear()

    async def drain(self, timeout: float) -> None:
        """Give queued messages a bounded chance to go out (shutdown)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._queue and loop.time() < deadline:
            await asyncio.sleep(0.05)
