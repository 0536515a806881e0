"""Election: one contract suite every compare-and-set backend passes, and the handler's
behaviour on the in-memory fake (time is a manual clock)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

from coordinator import presence
from coordinator.cas import Conflict, MemoryCasStore
from coordinator.election import GONE_ROUNDS, Election, Role
from coordinator.embedded_nats import NatsServer
from coordinator.kvstore import KvCasStore, ensure_layout
from ringmaster.clock import ManualClock

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["memory", "jetstream"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[object]:
    if request.param == "memory":
        yield MemoryCasStore()
        return
    server: NatsServer = request.getfixturevalue("nats_server")
    nc = await nats.connect(server.url)
    buckets = await ensure_layout(nc.jetstream(), "test")
    yield KvCasStore(buckets.leader)
    await nc.close()


async def test_create_is_exclusive(store) -> None:  # type: ignore[no-untyped-def]
    rev = await store.create("k", b"a")
    assert await store.get("k") == (b"a", rev)
    with pytest.raises(Conflict):
        await store.create("k", b"b")


async def test_update_needs_the_current_revision(store) -> None:  # type: ignore[no-untyped-def]
    rev = await store.create("k", b"a")
    rev2 = await store.update("k", b"b", rev)
    assert rev2 > rev
    with pytest.raises(Conflict):
        await store.update("k", b"c", rev)
    assert await store.get("k") == (b"b", rev2)


async def test_missing_key_reads_as_none(store) -> None:  # type: ignore[no-untyped-def]
    assert await store.get("absent") is None
    with pytest.raises(Conflict):
        await store.update("absent", b"x", 5)


def pair(ttl: float = 2.0) -> tuple[Election, Election, ManualClock, ManualClock]:
    """Two coordinators over one store, each on a clock of its own."""
    store = MemoryCasStore()
    ca, cb = ManualClock(), ManualClock()
    return Election(store, "a", ttl, ca), Election(store, "b", ttl, cb), ca, cb


async def test_first_comer_leads_and_the_other_follows() -> None:
    a, b, _, _ = pair()
    assert await a.step() is Role.LEADER
    assert await b.step() is Role.FOLLOWER
    assert b.holder == "a"
    assert a.epoch > 0


async def test_standby_takes_over_only_after_ttl_of_silence() -> None:
    a, b, _, cb = pair(ttl=2.0)
    await a.step()
    await b.step()
    cb.advance(1.9)
    assert await b.step() is Role.FOLLOWER
    await a.step()  # a renews: b must restart its count
    cb.advance(1.6)
    assert await b.step() is Role.FOLLOWER
    cb.advance(2.1)
    assert await b.step() is Role.LEADER
    assert b.epoch > a.epoch


async def test_deposed_leader_steps_down_on_its_next_renewal() -> None:
    a, b, _, cb = pair(ttl=1.0)
    await a.step()
    await b.step()
    cb.advance(1.5)
    await b.step()
    assert b.role is Role.LEADER
    assert await a.step() is Role.FOLLOWER
    assert a.holder is None


async def test_a_holder_the_bus_says_is_gone_loses_its_lease_before_the_ttl() -> None:
    gone: dict[str, bool] = {"a": False}
    asked: list[str] = []

    async def holder_gone(holder: str) -> bool:
        asked.append(holder)
        return gone[holder]

    store, ca, cb = MemoryCasStore(), ManualClock(), ManualClock()
    a = Election(store, "a", 2.0, ca)
    b = Election(store, "b", 2.0, cb, holder_gone=holder_gone)
    await a.step()
    await b.step()  # sees the revision
    cb.advance(0.2)
    assert await b.step() is Role.FOLLOWER and asked == ["a"]  # alive: nothing happens
    gone["a"] = True
    cb.advance(0.2)
    assert await b.step() is Role.FOLLOWER  # one round is not enough: a blip
    gone["a"] = False
    cb.advance(0.2)
    assert await b.step() is Role.FOLLOWER  # back: the count starts again
    gone["a"] = True
    cb.advance(0.2)
    assert await b.step() is Role.FOLLOWER
    cb.advance(0.2)
    assert await b.step() is Role.LEADER  # two rounds in a row, well before the 2 s TTL
    assert b.epoch > a.epoch
    # fencing unchanged: the holder wrongly taken for dead loses its next renewal
    assert await a.step() is Role.FOLLOWER


async def test_a_standby_takes_the_lease_once_the_bus_holds_no_connection_of_the_holder(
    nats_server: NatsServer,
) -> None:
    """Over a real server: the standby's clock never moves, so only the bus's word that
    the holder's connection is gone can hand it the lease."""
    holder_nc, standby_nc = await nats.connect(nats_server.url), await nats.connect(nats_server.url)
    try:
        lease = await ensure_layout(standby_nc.jetstream(), "test")
        held = await ensure_layout(holder_nc.jetstream(), "test")
        await presence.answer(holder_nc, "test", "a")
        a = Election(KvCasStore(held.leader), "a", 2.0, ManualClock())
        gone = presence.prober(standby_nc, "test")
        b = Election(KvCasStore(lease.leader), "b", 2.0, ManualClock(), holder_gone=gone)
        assert await a.step() is Role.LEADER
        for _ in range(GONE_ROUNDS + 2):
            assert await b.step() is Role.FOLLOWER  # the holder answers: alive
        await holder_nc.close()  # what the server sees of a kill -9
        roles = [await b.step() for _ in range(GONE_ROUNDS + 1)]
        assert roles[-1] is Role.LEADER and b.epoch > a.epoch, roles
    finally:
        await standby_nc.close()


async def test_a_record_of_our_own_is_never_taken_for_a_gone_holder() -> None:
    async def holder_gone(holder: str) -> bool:
        return True

    store, clock = MemoryCasStore(), ManualClock()
    await Election(store, "a", 2.0, ManualClock()).step()  # "a" in a previous life
    again = Election(store, "a", 2.0, clock, holder_gone=holder_gone)
    assert await again.step() is Role.FOLLOWER
    for _ in range(3):
        clock.advance(0.2)
        assert await again.step() is Role.FOLLOWER
    clock.advance(1.5)  # 2.1 s since it first saw the record
    assert await again.step() is Role.LEADER  # its own record is waited out


async def test_leader_that_cannot_renew_steps_down_before_ttl() -> None:
    class Broken(MemoryCasStore):
        fail = False

        async def update(self, key: str, value: bytes, last: int) -> int:
            if self.fail:
                raise ConnectionError("bus down")
            return await super().update(key, value, last)

    store = Broken()
    clock = ManualClock()
    a = Election(store, "a", 2.0, clock)
    await a.step()
    store.fail = True
    clock.advance(1.0)
    with pytest.raises(ConnectionError):
        await a.step()
    assert a.role is Role.LEADER
    clock.advance(0.7)
    with pytest.raises(ConnectionError):
        await a.step()
    assert a.role is Role.FOLLOWER


async def test_epochs_only_grow_across_terms() -> None:
    a, b, ca, cb = pair(ttl=1.0)
    seen: list[int] = []
    leaders: list[tuple[Election, ManualClock]] = [(a, ca), (b, cb)]
    await a.step()
    seen.append(a.epoch)
    for turn in range(4):
        nxt, clock = leaders[(turn + 1) % 2]
        await nxt.step()
        clock.advance(1.5)
        await nxt.step()
        assert nxt.role is Role.LEADER
        seen.append(nxt.epoch)
        prev, _ = leaders[turn % 2]
        await prev.step()
        assert prev.role is Role.FOLLOWER
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


async def test_a_released_lease_is_taken_at_once() -> None:
    a, b, _, _ = pair(ttl=30.0)
    await a.step()
    await b.step()
    first = a.epoch
    await a.release()
    assert a.role is Role.FOLLOWER
    assert await b.step() is Role.LEADER
    assert b.epoch > first
