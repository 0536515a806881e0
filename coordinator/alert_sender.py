"""Sending alerts (decided in :mod:`.alerts`) to webhooks without ever holding up the
coordinator: :meth:`Alerter.notify` only decides and enqueues; each URL has its own bounded
queue (oldest dropped first, counted) drained by its own task, rate-limited by a token
bucket and retried with exponential backoff, so a dead or slow chat service delays only
its own messages. HTTP is a minimal HTTP/1.1 POST over ``asyncio.open_connection`` (TLS
with the default context for https): no dependency for one request shape.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog

from coordinator.alerts import Alert, AlertPolicy, AlertSettings, TokenBucket, payload
from proto.events import EventBase

log = structlog.get_logger()
QUEUE = 256  # messages waiting per URL; beyond it the oldest is dropped
IDLE_TICK_S = 0.25  # how often held node alerts are looked at


@dataclass(frozen=True)
class Retry:
    attempts: int = 5
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    timeout_s: float = 10.0


class HttpError(Exception):
    pass


async def post_json(url: str, body: bytes, timeout: float) -> int:
    """POST ``body`` as JSON; the response's status code. Connection errors and timeouts
    raise (OSError, TimeoutError, HttpError)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HttpError(f"not an http(s) URL: {parts.scheme}://{parts.hostname or ''}")
    tls = ssl.create_default_context() if parts.scheme == "https" else None
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc.rpartition('@')[2]}\r\n"
        "Content-Type: application/json\r\nUser-Agent: ringmaster-coordinator\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )

    async def exchange() -> int:
        reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=tls)
        try:
            writer.write(head.encode() + body)
            await writer.drain()
            status = (await reader.readline()).split()
            if len(status) < 2 or not status[1].isdigit():
                raise HttpError(f"malformed status line {b' '.join(status)!r}")
            return int(status[1])
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    return await asyncio.wait_for(exchange(), timeout)


class Webhook:
    """One URL's queue and the task that drains it."""

    def __init__(self, url: str, settings: AlertSettings, retry: Retry) -> None:
        self.url, self.retry = url, retry
        self.bucket = TokenBucket(settings.rate_per_s, settings.burst, time.monotonic())
        self.queue: collections.deque[bytes] = collections.deque()
        self.sent = self.dropped = self.failed = 0
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._drain(), name="alerts")

    def put(self, body: bytes) -> None:
        if len(self.queue) >= QUEUE:
            self.queue.popleft()
            self.dropped += 1
            log.warning("alert dropped: queue full", dropped=self.dropped)
        self.queue.append(body)
        self._wake.set()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _drain(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                while (wait := self.bucket.take(time.monotonic())) > 0:
                    await asyncio.sleep(wait)
                await self._deliver(self.queue.popleft())

    async def _deliver(self, body: bytes) -> None:
        """Retried on connection errors, timeouts, 429 and 5xx; another 4xx is the
        message's or the URL's fault and retrying cannot help."""
        delay, outcome = self.retry.first_delay_s, ""
        for attempt in range(1, self.retry.attempts + 1):
            try:
                code = await post_json(self.url, body, self.retry.timeout_s)
            except (OSError, TimeoutError, HttpError) as exc:
                outcome = repr(exc)
            else:
                if 200 <= code < 300:
                    self.sent += 1
                    return
                outcome = f"HTTP {code}"
                if code < 500 and code != 429:
                    break
            if attempt < self.retry.attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry.max_delay_s)
        self.failed += 1
        # the URL may embed a token: log only where it points
        log.warning("alert not delivered", to=urlsplit(self.url).hostname, outcome=outcome)


class Alerter:
    """The coordinator's alerting: ``notify`` on the leader for every event, once."""

    def __init__(
        self,
        route: Callable[[EventBase], frozenset[str]],
        settings: AlertSettings | None = None,
        retry: Retry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.route, self.clock = route, clock
        self.settings, self.retry = settings or AlertSettings(), retry or Retry()
        self.policy = AlertPolicy(self.settings)
        self.hooks: dict[str, Webhook] = {}
        self._ticker: asyncio.Task[None] | None = None

    def notify(self, event: EventBase) -> None:
        """Decide and enqueue; never waits and never raises (alerting must not be the
        reason an event goes unhandled). Call from the event loop."""
        try:
            self._send(self.policy.offer(event, self.route(event), self.clock()))
            if self._ticker is None:
                self._ticker = asyncio.create_task(self._tick(), name="alerts-summary")
        except Exception as exc:
            log.error("alerting failed", error=repr(exc))

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for hook in self.hooks.values():
            await hook.close()

    def _send(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            hook = self.hooks.get(alert.url)
            if hook is None:
                hook = self.hooks[alert.url] = Webhook(alert.url, self.settings, self.retry)
            hook.put(json.dumps(payload(alert.text)).encode())

    async def _tick(self) -> None:
        """Held node alerts go out when their summary window ends."""
        while True:
            await asyncio.sleep(min(IDLE_TICK_S, self.settings.summary_window_s))
            try:
                self._send(self.policy.due(self.clock()))
            except Exception as exc:
                log.error("alerting failed", error=repr(exc))
