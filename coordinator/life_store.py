"""Node life records behind the compare-and-set seam (:mod:`coordinator.cas`), fenced as
the job records are (:mod:`coordinator.jobstore`): every write names the revision this
leader last read or wrote, so a deposed leader's late write loses
(:class:`~coordinator.cas.Conflict`) instead of overwriting its successor's record."""

from __future__ import annotations

import msgspec
import structlog

from coordinator.cas import CasStore
from proto.codec import encode
from proto.node_life import NodeLife

log = structlog.get_logger()
_decoder = msgspec.json.Decoder(NodeLife)


class LifeStore:
    def __init__(self, cas: CasStore) -> None:
        self.cas = cas
        self._revs: dict[str, int] = {}

    async def load(self) -> dict[str, NodeLife]:
        """Every node's record (a new leader goes on from them); one that does not decode
        is skipped with a warning: that node starts afresh from its agent's reports."""
        self._revs.clear()
        lives = {}
        for key in await self.cas.keys():
            life = await self.read(key)
            if life is not None:
                lives[key] = life
        return lives

    async def read(self, node: str) -> NodeLife | None:
        found = await self.cas.get(node)
        if found is None:
            return None
        data, rev = found
        self._revs[node] = rev
        try:
            return _decoder.decode(data)
        except msgspec.DecodeError as exc:
            log.warning("unreadable node life record skipped", node=node, error=str(exc))
            return None

    async def save(self, life: NodeLife) -> None:
        """Compare-and-set on the record's revision; Conflict when another leader wrote."""
        data, last = encode(life), self._revs.get(life.node)
        if last is None:
            self._revs[life.node] = await self.cas.create(life.node, data)
        else:
            self._revs[life.node] = await self.cas.update(life.node, data, last)
