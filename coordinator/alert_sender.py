"""Sending alerts (decided in :mod:`.alerts`) to webhooks without ever holding up the
coordinator: :meth:`Alerter.notify` only decides and enqueues; each URL has its own bounded
queue (oldest dropped first, counted) drained by its own task, rate-limited by a token
bucket and retried with the shared jittered backoff (:mod:`ringmaster.retry`), so a dead
or slow chat service delays only its own messages.

HTTP is httpx's: proxies from the environment (``HTTPS_PROXY``, ``HTTP_PROXY``,
``NO_PROXY``), credentials in the URL sent as basic auth, TLS verified against the system's
trust store (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` honoured), a timeout on each of connect,
write, read and pool, and redirects not followed: a POST that moved is the URL's fault.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import structlog

from coordinator.alerts import Alert, AlertPolicy, AlertSettings, TokenBucket, payload
from proto.events import EventBase
from ringmaster.clock import SYSTEM, Clock
from ringmaster.retry import retrying_async

log = structlog.get_logger()
QUEUE = 256  # messages waiting per URL; beyond it the oldest is dropped
IDLE_TICK_S = 0.25  # how often held node alerts are looked at


@dataclass(frozen=True)
class Retry:
    attempts: int = 5
    first_delay_s: float = 0.5  # the first wait is within [0, this], doubling to the cap
    max_delay_s: float = 30.0
    timeout_s: float = 10.0


class Busy(Exception):
    """The service answered that it cannot take the message now (429 or 5xx)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"HTTP {code}")
        self.code = code


# What retrying can help with: the network, the proxy, a timeout, a garbled answer, a busy
# service (not a URL httpx cannot speak to, nor one it refuses to send).
RETRIED = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.ProxyError,
    httpx.RemoteProtocolError,
    Busy,
)


def client(retry: Retry) -> httpx.AsyncClient:
    """The one HTTP client of the coordinator's alerting (its pool is shared by all URLs)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(retry.timeout_s),
        follow_redirects=False,
        verify=ssl.create_default_context(),
        trust_env=True,
        headers={"User-Agent": "ringmaster-coordinator"},
    )


class Webhook:
    """One URL's queue and the task that drains it."""

    def __init__(
        self,
        url: str,
        settings: AlertSettings,
        retry: Retry,
        http: httpx.AsyncClient,
        clock: Clock,
    ) -> None:
        self.url, self.retry, self.http, self.clock = url, retry, http, clock
        self.bucket = TokenBucket(settings.rate_per_s, settings.burst, clock.monotonic())
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
                while (wait := self.bucket.take(self.clock.monotonic())) > 0:
                    await asyncio.sleep(wait)
                await self._deliver(self.queue.popleft())

    async def _deliver(self, body: bytes) -> None:
        """Retried on connection, proxy and protocol errors, timeouts, 429 and 5xx; any
        other answer is final (a 4xx is the message's or the URL's fault, a 3xx a URL
        that moved: retrying cannot help)."""
        retrying = retrying_async(
            RETRIED,
            first_s=self.retry.first_delay_s,
            cap_s=max(self.retry.max_delay_s, self.retry.first_delay_s),
            attempts=self.retry.attempts,
        )
        try:
            code: int = await retrying(self._post, body)
        except Exception as exc:  # tries spent, or no use: this message fails, the queue goes on
            outcome = str(exc) if isinstance(exc, Busy) else repr(exc)
        else:
            if 200 <= code < 300:
                self.sent += 1
                return
            outcome = f"HTTP {code}"
        self.failed += 1
        # the URL may embed a token: log only where it points
        log.warning("alert not delivered", to=urlsplit(self.url).hostname, outcome=outcome)

    async def _post(self, body: bytes) -> int:
        response = await self.http.post(
            self.url, content=body, headers={"Content-Type": "application/json"}
        )
        if response.status_code == 429 or response.status_code >= 500:
            raise Busy(response.status_code)
        return response.status_code


class Alerter:
    """The coordinator's alerting: ``notify`` on the leader for every event, once."""

    def __init__(
        self,
        route: Callable[[EventBase], frozenset[str]],
        settings: AlertSettings | None = None,
        retry: Retry | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.route, self.clock = route, clock
        self.settings, self.retry = settings or AlertSettings(), retry or Retry()
        self.policy = AlertPolicy(self.settings)
        self.hooks: dict[str, Webhook] = {}
        self.http = client(self.retry)  # reads the proxy settings from the environment now
        self._ticker: asyncio.Task[None] | None = None

    def notify(self, event: EventBase) -> None:
        """Decide and enqueue; never waits and never raises (alerting must not be the
        reason an event goes unhandled). Call from the event loop."""
        try:
            self._send(self.policy.offer(event, self.route(event), self.clock.monotonic()))
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
        await self.http.aclose()

    def _send(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            hook = self.hooks.get(alert.url)
            if hook is None:
                hook = Webhook(alert.url, self.settings, self.retry, self.http, self.clock)
                self.hooks[alert.url] = hook
            hook.put(json.dumps(payload(alert.text)).encode())

    async def _tick(self) -> None:
        """Held node alerts go out when their summary window ends."""
        while True:
            await asyncio.sleep(min(IDLE_TICK_S, self.settings.summary_window_s))
            try:
                self._send(self.policy.due(self.clock.monotonic()))
            except Exception as exc:
                log.error("alerting failed", error=repr(exc))
