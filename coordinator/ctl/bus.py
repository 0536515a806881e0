"""The CLI's side of the bus: connect once, read KV directly (``status`` needs no leader),
and ask the leader over request/reply."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, NoKeysError, NotFoundError
from nats.js.kv import KeyValue

from coordinator.ctl.errors import CtlError
from proto import subjects
from proto.api import ApiReply
from proto.codec import api_reply_decoder, encode

T = TypeVar("T")


@dataclass
class Session:
    nc: Client
    js: JetStreamContext
    cluster: str
    url: str

    async def bucket(self, what: str) -> KeyValue:
        try:
            return await self.js.key_value(subjects.bucket(self.cluster, what))
        except (BucketNotFoundError, NotFoundError):
            raise CtlError(
                f"no Ringmaster state for cluster {self.cluster!r} at {self.url} "
                "(has a coordinator run there?)"
            ) from None

    async def records(self, what: str, kind: type[T]) -> list[T]:
        kv = await self.bucket(what)
        out: list[T] = []
        with contextlib.suppress(NotFoundError, NoKeysError):
            for key in await kv.keys():
                with contextlib.suppress(NotFoundError, msgspec.DecodeError):
                    entry = await kv.get(key)
                    if entry.value:
                        out.append(msgspec.json.decode(entry.value, type=kind))
        return out

    async def record(self, what: str, key: str, kind: type[T]) -> T | None:
        kv = await self.bucket(what)
        try:
            entry = await kv.get(key)
        except (NotFoundError, ValueError):
            return None
        return msgspec.json.decode(entry.value, type=kind) if entry.value else None

    async def ask(self, verb: str, request: object, timeout: float = 15.0) -> ApiReply:
        try:
            msg = await self.nc.request(
                subjects.api(self.cluster, verb), encode(request), timeout=timeout
            )
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
async def session(url: str, cluster: str) -> AsyncIterator[Session]:
    import nats

    async def quiet(_: Exception) -> None:
        """nats-py logs tracebacks by default; the CLI reports one line instead."""

    try:
        nc = await nats.connect(
            servers=url.split(","),
            connect_timeout=3,
            max_reconnect_attempts=1,
            allow_reconnect=False,
            name="coordinatorctl",
            error_cb=quiet,
        )
    except (NoServersError, OSError, NatsError, TimeoutError) as exc:
        raise CtlError(f"cannot reach NATS at {url}: {exc or type(exc).__name__}") from None
    try:
        yield Session(nc=nc, js=nc.jetstream(), cluster=cluster, url=url)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
