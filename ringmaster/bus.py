"""Connecting to NATS and publishing events where delivery matters (JetStream acks)."""

from __future__ import annotations

from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from proto import subjects
from proto.codec import encode
from proto.events import EventBase, kind_of, scope_of
from ringmaster import auth

log = structlog.get_logger()
DEFAULT_URL = "nats://127.0.0.1:4222"


async def connect(url: str, name: str, creds: str | None = None, **kwargs: Any) -> Client:
    """Connect with unbounded reconnects: daemons ride out a NATS restart or failover.
    ``creds`` is a creds file (``ringmaster.auth``). Credentials refused on the first
    connection raise :class:`ringmaster.auth.Refused` at once: nats-py would otherwise retry
    them forever, and no retry fixes a wrong password."""
    connected = False

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", error=str(exc))
        if not connected and isinstance(exc, NatsError) and auth.is_refused(exc):
            # raised inside nats-py's connect loop, this ends it
            raise auth.Refused(f"NATS at {url} refused {name} ({creds or 'no creds'})")

    nc = await nats.connect(
        servers=url.split(","),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        error_cb=on_error,
        **auth.connect_options(creds),
        **kwargs,
    )
    connected = True
    return nc


def event_subject(cluster: str, event: EventBase) -> str:
    scope, ident = scope_of(event)
    return subjects.event(cluster, scope, ident, kind_of(event))


async def publish_event(js: JetStreamContext, cluster: str, event: EventBase) -> None:
    """Publish into the event stream and wait for the ack: the on-call engineer's history
    must not silently lose events."""
    await js.publish(event_subject(cluster, event), encode(event), timeout=5)
