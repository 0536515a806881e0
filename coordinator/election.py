"""Leadership as a handler (:class:`Election`, a small state machine) over a backend (a
compare-and-set store with revisions (:mod:`coordinator.cas`): JetStream KV in production,
:class:`~coordinator.cas.MemoryCasStore` in pure tests; both pass the same contract suite).

The lease is one key. The leader renews it by compare-and-set on its revision. A standby
watches the revision and takes the lease (compare-and-set on the revision it saw) once the
revision has not changed for ``ttl`` on the standby's *own* monotonic clock — the
Kubernetes lease rule, which needs no agreement between clocks. The revision at which a
coordinator acquired the lease is its epoch: every command carries it and agents refuse
older ones (fencing). A leader that cannot renew steps down after ``0.8 × ttl``, before
any standby may take over.

A holder that died need not be waited out: with ``holder_gone`` (the bus's word that no
connection of the holder is left: a request to its ``alive`` subject finds no responder),
a standby takes the lease after ``GONE_ROUNDS`` rounds in a row that say so, by the same
compare-and-set. A holder that is alive but silent (starved, cut off from the store yet
still on the bus) is not gone: the TTL decides, as before. Fencing is unchanged: a holder
that was wrongly taken for dead loses its next renewal's compare-and-set and steps down,
and agents refuse its epoch once they have seen the new one.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable

import msgspec

from coordinator.cas import CasStore, Conflict
from ringmaster.clock import SYSTEM, Clock

LEASE_KEY = "leader"
GONE_ROUNDS = 2  # rounds in a row the bus says the holder is gone before its lease is taken
HolderGone = Callable[[str], Awaitable[bool]]


class LeaseRecord(msgspec.Struct, kw_only=True):
    holder: str
    epoch: int = 0  # 0 until the holder's first renewal records its acquisition revision
    renewed_at: float = 0.0  # wall clock, for humans only; never used to decide


class Role(enum.StrEnum):
    """follower → leader (acquired: key absent or released, or revision unchanged for ttl);
    leader → follower (released on shutdown, a renewal lost its compare-and-set, or none
    succeeded for 0.8 ttl)."""

    FOLLOWER = "follower"
    LEADER = "leader"


class Election:
    def __init__(
        self,
        store: CasStore,
        me: str,
        ttl: float = 2.0,
        clock: Clock = SYSTEM,
        holder_gone: HolderGone | None = None,
    ) -> None:
        self.store = store
        self.me = me
        self.ttl = ttl
        self.clock = clock
        self.role = Role.FOLLOWER
        self.epoch = 0
        self.holder: str | None = None
        self._rev = 0
        self._seen_rev: int | None = None
        self._seen_at = 0.0
        self._renewed_at = 0.0
        self.holder_gone = holder_gone
        self._gone = 0  # rounds in a row the holder was reported gone

    @property
    def renew_every(self) -> float:
        return self.ttl / 4

    async def step(self) -> Role:
        """One round: renew if leading, else watch the lease and take it when it lapses."""
        now = self.clock.monotonic()
        if self.role is Role.LEADER:
            await self._renew(now)
            return self.role
        current = await self.store.get(LEASE_KEY)
        if current is None:
            await self._acquire(now, None)
            return self.role
        value, rev = current
        try:
            self.holder = msgspec.json.decode(value, type=LeaseRecord).holder
        except msgspec.DecodeError:
            self.holder = None
        if not self.holder:
            await self._acquire(now, rev)  # released by a leader that shut down cleanly
        elif rev != self._seen_rev:
            # A record of ours from a previous life is waited out like anyone else's.
            self._seen_rev, self._seen_at, self._gone = rev, now, 0
        elif now - self._seen_at >= self.ttl:
            await self._acquire(now, rev)
        elif self.holder_gone is not None and self.holder != self.me:
            self._gone = self._gone + 1 if await self.holder_gone(self.holder) else 0
            if self._gone >= GONE_ROUNDS:
                await self._acquire(now, rev)
        return self.role

    async def _acquire(self, now: float, last: int | None) -> None:
        record = msgspec.json.encode(LeaseRecord(holder=self.me, renewed_at=self.clock.time()))
        try:
            rev = (
                await self.store.create(LEASE_KEY, record)
                if last is None
                else await self.store.update(LEASE_KEY, record, last)
            )
        except Conflict:
            self._seen_rev, self._gone = None, 0
            return
        self.role, self.epoch, self._rev, self._renewed_at = Role.LEADER, rev, rev, now
        self.holder = self.me
        await self._renew(now)

    async def _renew(self, now: float) -> None:
        record = LeaseRecord(holder=self.me, epoch=self.epoch, renewed_at=self.clock.time())
        try:
            self._rev = await self.store.update(LEASE_KEY, msgspec.json.encode(record), self._rev)
            self._renewed_at = now
        except Conflict:
            self._step_down()
        except Exception:
            if now - self._renewed_at >= 0.8 * self.ttl:
                self._step_down()
            raise

    async def release(self) -> None:
        """Hand the lease over at once on a clean shutdown (no standby waits out the TTL)."""
        if self.role is not Role.LEADER:
            return
        record = LeaseRecord(holder="", epoch=self.epoch, renewed_at=self.clock.time())
        try:
            await self.store.update(LEASE_KEY, msgspec.json.encode(record), self._rev)
        finally:
            self._step_down()

    def _step_down(self) -> None:
        self.role = Role.FOLLOWER
        self._rev = 0
        self._seen_rev = None
        self.holder = None
