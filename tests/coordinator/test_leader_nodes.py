"""The leader's node-record writer (coordinator.node_records): changes go out at once,
unchanged nodes are not rewritten every pass, and nodes that join mid-pass do not break it."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.node_records import NodeRecords
from coordinator.registry import Registry
from proto.conditions import Condition, ConditionKind
from proto.node import Heartbeat
from ringmaster.clock import ManualClock

pytestmark = pytest.mark.anyio


class FakeKv:
    """Implements the one KV call the writer uses; each put yields, so heartbeats (new
    nodes) can arrive while a pass is in flight, as they do for real."""

    def __init__(self, registry: Registry) -> None:
        self.puts: list[str] = []
        self.registry = registry

    async def put(self, key: str, value: bytes) -> int:
        self.puts.append(key)
        joiner = f"late-{len(self.puts)}"
        if len(self.puts) <= 3:
            self.registry.observe(Heartbeat(node=joiner, seq=1, sent_at=0.0), 0.0)
        await asyncio.sleep(0)
        return len(self.puts)


async def test_changes_are_written_at_once_and_unchanged_nodes_are_not() -> None:
    registry = Registry()
    for i in range(20):
        registry.observe(Heartbeat(node=f"n{i}", seq=1, sent_at=0.0), 0.0)
    kv = FakeKv(registry)
    # a still clock: no refresh falls due between the passes
    records = NodeRecords(registry, kv, ManualClock())
    await records.write()
    assert sorted(kv.puts) == sorted(f"n{i}" for i in range(20))
    kv.puts.clear()
    await records.write()  # the three late joiners, nothing else
    assert sorted(kv.puts) == ["late-1", "late-2", "late-3"]
    kv.puts.clear()
    await records.write()
    assert kv.puts == []
    registry.observe_condition(
        Condition(kind=ConditionKind.NVME_LATENCY, node="n7", subject="nvme0n1", since=1.0)
    )
    await records.write()
    assert kv.puts == ["n7"]
