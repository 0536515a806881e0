"""The CLI's side of the bus: connect once, read KV directly (``status`` needs no leader),
and ask the leader over request/reply."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from coordinator.ctl.errors import CtlError
from coordinator.kvstore import decoded
from proto import subjects
from proto.api import ApiReply
from proto.codec import api_reply_decoder, encode
from ringmaster import auth

T = TypeVar("T")


@dataclass
class Session:
    nc: Client
    js: JetStreamContext
    cluster: str
    url: str
    # the server's "permissions violation" notices, which arrive apart from the request
    denied: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    unreadable: list[str] = field(default_factory=list)

    async def bucket(self, what: str) -> KeyValue:
        try:
            return await self.js.key_value(subjects.bucket(self.cluster, what))
        except (BucketNotFoundError, NotFoundError):
            raise CtlError(
                f"no Ringmaster state for cluster {self.cluster!r} at {self.url} "
                "(has a coordinator run there?)"
            ) from None

    async def records(self, what: str, kind: type[T]) -> list[T]:
        """Every record of a bucket; one that does not decode is named in ``unreadable``
        (``status`` prints it as a warning) instead of vanishing from the listing."""
        found, unreadable = await decoded(await self.bucket(what), kind)
        self.unreadable += [f"{what} {line}" for line in unreadable]
        return found

    async def record(self, what: str, key: str, kind: type[T]) -> T | None:
        kv = await self.bucket(what)
        try:
            entry = await kv.get(key)
        except (NotFoundError, ValueError):
            return None
        if not entry.value:
            return None
        try:
            return msgspec.json.decode(entry.value, type=kind)
        except msgspec.DecodeError as exc:
            raise CtlError(f"{what} record {key!r} does not decode: {exc}") from None

    async def ask(self, verb: str, request: object, timeout: float = 15.0) -> ApiReply:
        asked = asyncio.ensure_future(
            self.nc.request(subjects.api(self.cluster, verb), encode(request), timeout=timeout)
        )
        refusal = asyncio.ensure_future(self.denied.get())
        await asyncio.wait({asked, refusal}, return_when=asyncio.FIRST_COMPLETED)
        refusal.cancel()
        if not asked.done():
            asked.cancel()
            raise CtlError(f"{verb}: {refusal.result()} (these creds may not)", code=2)
        try:
            msg = await asked
        except NoRespondersError:
            raise CtlError(
                f"no coordinator is leading cluster {self.cluster!r} at {self.url}"
            ) from None
        except (NatsTimeout, TimeoutError):
            raise CtlError(f"the coordinator did not answer within {timeout:.0f} s") from None
        try:
            return api_reply_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            raise CtlError(f"bad reply from the coordinator: {exc}") from None


@contextlib.asynccontextmanager
async def session(url: str, cluster: str, creds: str | None = None) -> AsyncIterator[Session]:
    import nats

    denied: asyncio.Queue[str] = asyncio.Queue()

    async def quiet(exc: Exception) -> None:
        """nats-py logs tracebacks by default; the CLI reports one line instead."""
        if "permissions violation" in str(exc):
            denied.put_nowait(str(exc).removeprefix("nats: "))

    try:
        options = auth.connect_options(creds)
    except auth.CredsError as exc:
        raise CtlError(str(exc), code=2) from None
    try:
        nc = await nats.connect(
            servers=url.split(","),
            connect_timeout=3,
            max_reconnect_attempts=1,
            allow_reconnect=False,
            name="coordinatorctl",
            error_cb=quiet,
            **options,
        )
    except NatsError as exc:
        if auth.is_refused(exc):
            who = f"the credentials in {creds}" if creds else "a connection without credentials"
            raise CtlError(f"NATS at {url} refused {who}", code=2) from None
        raise CtlError(f"cannot reach NATS at {url}: {exc or type(exc).__name__}") from None
    except (OSError, TimeoutError) as exc:
        raise CtlError(f"cannot reach NATS at {url}: {exc or type(exc).__name__}") from None
    try:
        yield Session(nc=nc, js=nc.jetstream(), cluster=cluster, url=url, denied=denied)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
