"""The compare-and-set seam every piece of coordinator state goes through: the leader lease
(:mod:`coordinator.election`) and the job records (:mod:`coordinator.jobstore`).

A :class:`CasStore` holds bytes per key with a revision that only grows; a write names the
revision it read, and loses (:class:`Conflict`) if anyone wrote since. JetStream KV is the
production backend (:class:`coordinator.kvstore.KvCasStore`); :class:`MemoryCasStore`,
shipped beside the protocol, passes the same contract suite and lets the handlers be
tested without a server.
"""

from __future__ import annotations

from typing import Protocol


class Conflict(Exception):
    """The compare-and-set lost: the key changed (or exists) since the caller looked."""


class CasStore(Protocol):
    async def get(self, key: str) -> tuple[bytes, int] | None: ...
    async def create(self, key: str, value: bytes) -> int: ...
    async def update(self, key: str, value: bytes, last: int) -> int: ...
    async def keys(self) -> list[str]: ...


class MemoryCasStore:
    """In-memory CasStore with one global revision counter, like a JetStream stream."""

    def __init__(self) -> None:
        self._data: dict[str, tuple[bytes, int]] = {}
        self._rev = 0

    async def get(self, key: str) -> tuple[bytes, int] | None:
        return self._data.get(key)

    async def create(self, key: str, value: bytes) -> int:
        if key in self._data:
            raise Conflict(key)
        return self._put(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        current = self._data.get(key)
        if current is None or current[1] != last:
            raise Conflict(key)
        return self._put(key, value)

    async def keys(self) -> list[str]:
        return sorted(self._data)

    def _put(self, key: str, value: bytes) -> int:
        self._rev += 1
        self._data[key] = (value, self._rev)
        return self._rev
