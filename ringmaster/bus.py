"""Connecting to NATS and publishing events where delivery matters (JetStream acks)."""

from __future__ import annotations

from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext

from proto import subjects
from proto.codec import encode
from proto.events import EventBase, kind_of, scope_of

log = structlog.get_logger()
DEFAULT_URL = "nats://127.0.0.1:4222"


async def connect(url: str, name: str, **kwargs: Any) -> Client:
    """Connect with unbounded reconnects: daemons ride out a NATS restart or failover."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", error=str(exc))

    return await nats.connect(
        servers=url.split(","),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        error_cb=on_error,
        **kwargs,
    )


def event_subject(cluster: str, event: EventBase) -> str:
    scope, ident = scope_of(event)
    return subjects.event(cluster, scope, ident, kind_of(event))


async def publish_event(js: JetStreamContext, cluster: str, event: EventBase) -> None:
    """Publish into the event stream and wait for the ack: the on-call engineer's history
    must not silently lose events."""
    await js.publish(event_subject(cluster, event), encode(event), timeout=5)
