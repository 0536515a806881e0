"""JetStream KV as a compare-and-set store (the production backend of the election and the
job records), and
the bucket/stream set-up every coordinator runs at start (idempotent)."""

from __future__ import annotations

import contextlib
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import (
    BadRequestError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from coordinator.cas import Conflict
from proto import subjects

T = TypeVar("T")


class KvCasStore:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get(self, key: str) -> tuple[bytes, int] | None:
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if entry.value is None or entry.revision is None:
            return None
        return entry.value, entry.revision

    async def create(self, key: str, value: bytes) -> int:
        try:
            return await self.kv.create(key, value)
        except KeyWrongLastSequenceError as exc:
            raise Conflict(key) from exc

    async def update(self, key: str, value: bytes, last: int) -> int:
        try:
            return await self.kv.update(key, value, last=last)
        except KeyWrongLastSequenceError as exc:
            raise Conflict(key) from exc

    async def keys(self) -> list[str]:
        return await live_keys(self.kv)


async def live_keys(kv: KeyValue) -> list[str]:
    """Every key of a bucket, sorted, from one stream-info answer (the stream's message count
    per subject), taken at one instant on the server. A deleted key is still listed (its
    marker is a message); the caller's ``get`` skips it.

    Not nats-py's ``KeyValue.keys()``: it lists through a watcher that stops at the first
    message with nothing pending, so a write landing during the listing can end it early,
    a key short (1 listing in 100 with a record written every 10 ms, on a loaded machine).
    A new leader that loaded its jobs that way would forget a job, and ``status`` would
    miss a node. The server sends up to 100,000 subjects in one answer: far more nodes and
    jobs than a cluster has."""
    prefix = f"$KV.{kv._name}."  # nats-py keeps the bucket's name and stream private
    info = await kv._js.stream_info(kv._stream, subjects_filter=f"{prefix}>")
    subjects = info.state.subjects or {}
    return sorted(s.removeprefix(prefix) for s in subjects)


async def decoded(kv: KeyValue, kind: type[T]) -> tuple[list[T], list[str]]:
    """Every record of a bucket as ``kind``, and a line for each that does not decode
    (named, so that a reader can say so instead of dropping it in silence). A key deleted
    or gone since the listing is skipped."""
    out: list[T] = []
    unreadable: list[str] = []
    for key in await live_keys(kv):
        try:
            entry = await kv.get(key)
        except NotFoundError:
            continue
        if not entry.value:
            continue
        try:
            out.append(msgspec.json.decode(entry.value, type=kind))
        except msgspec.DecodeError as exc:
            unreadable.append(f"record {key!r} does not decode: {exc}")
    return out, unreadable


class Buckets:
    def __init__(
        self, jobs: KeyValue, nodes: KeyValue, leader: KeyValue, members: KeyValue, lives: KeyValue
    ):
        self.jobs = jobs
        self.nodes = nodes
        self.leader = leader
        self.members = members
        self.lives = lives  # each node's life (proto.node_life), compare-and-set


async def ensure_layout(js: JetStreamContext, cluster: str, replicas: int = 1) -> Buckets:
    """Create (or find) the event and progress streams and the KV buckets."""
    streams = [
        StreamConfig(
            name=subjects.events_stream(cluster),
            subjects=subjects.events_all(cluster),
            retention=RetentionPolicy.LIMITS,
            max_age=7 * 24 * 3600,
            max_bytes=1 << 30,
            duplicate_window=120,  # an agent's retried publish (Nats-Msg-Id) is stored once
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        StreamConfig(
            name=subjects.progress_stream(cluster),
            subjects=[subjects.progress_all(cluster)],
            retention=RetentionPolicy.LIMITS,
            max_age=24 * 3600,
            max_msgs_per_subject=10_000,
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
    ]
    for config in streams:
        try:
            await js.add_stream(config)
        except BadRequestError:
            with contextlib.suppress(BadRequestError):
                await js.update_stream(config)

    async def bucket(what: str, history: int, ttl: float | None = None) -> KeyValue:
        config = KeyValueConfig(
            bucket=subjects.bucket(cluster, what),
            history=history,
            ttl=ttl,
            replicas=replicas,
            direct=True,
        )
        try:
            return await js.create_key_value(config)
        except BadRequestError:
            return await js.key_value(config.bucket)

    return Buckets(
        jobs=await bucket("jobs", 5),
        nodes=await bucket("nodes", 1),
        leader=await bucket("leader", 1),
        members=await bucket("coordinators", 1, ttl=30),
        lives=await bucket("nodelife", 5),
    )


async def bind(js: JetStreamContext, cluster: str) -> Buckets:
    """The buckets :func:`ensure_layout` made, opened on another connection (no set-up)."""

    async def kv(what: str) -> KeyValue:
        return await js.key_value(subjects.bucket(cluster, what))

    return Buckets(
        jobs=await kv("jobs"),
        nodes=await kv("nodes"),
        leader=await kv("leader"),
        members=await kv("coordinators"),
        lives=await kv("nodelife"),
    )
