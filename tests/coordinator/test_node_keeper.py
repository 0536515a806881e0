"""The leader's keeper of node lives over an in-memory store and a manual clock: a fault
drains, its closing and the probation return the node, each said once; a new leader
changes nothing that is right; a deposed one's step stops at the store; the operator's
verbs, their refusals and an operator drain's evacuation."""

from __future__ import annotations

import pytest

from coordinator.cas import MemoryCasStore
from coordinator.life_store import LifeStore
from coordinator.node_keeper import NodeKeeper
from coordinator.node_life import PROBATION_S
from coordinator.registry import Registry
from proto.api import NodeControl
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import EventBase, NodeCordoned, NodeDrained, NodeReturned, kind_of
from proto.node import Heartbeat, NodeState
from proto.node_life import Phase
from ringmaster.clock import ManualClock

pytestmark = pytest.mark.anyio


def readonly(since: float, active: bool = True) -> Condition:
    return Condition(
        kind=ConditionKind.NVME_READONLY,
        node="node-1",
        subject="nvme0n1",
        severity=Severity.CRITICAL,
        active=active,
        since=since,
        reason="nvme0n1 read-only (ro=1)",
    )


class World:
    def __init__(self, store: MemoryCasStore | None = None) -> None:
        self.clock = ManualClock()
        self.registry = Registry()
        self.store = store or MemoryCasStore()
        self.events: list[EventBase] = []
        self.evacuated: list[tuple[str, str]] = []
        self.seq = 0
        self.keeper = self.new_keeper()

    def new_keeper(self) -> NodeKeeper:
        async def publish(event: EventBase) -> None:
            self.events.append(event)

        async def evacuate(node: str, why: str) -> None:
            self.evacuated.append((node, why))

        return NodeKeeper(self.registry, self.store, publish, evacuate, self.clock)

    def beat(self, node: str, *conditions: Condition) -> None:
        self.seq += 1
        beat = Heartbeat(node=node, seq=self.seq, sent_at=self.clock.time(), conditions=conditions)
        self.registry.observe(beat, self.clock.monotonic())

    async def after(self, seconds: float) -> None:
        self.clock.advance(seconds)
        await self.keeper.tick()

    def kinds(self) -> list[str]:
        return [kind_of(e) for e in self.events]


async def test_a_fault_drains_and_its_probation_returns_the_node_each_said_once() -> None:
    w = World()
    await w.keeper.load()
    w.beat("node-1")
    await w.after(0.0)
    assert w.events == [] and w.registry.nodes["node-1"].state is NodeState.READY
    w.beat("node-1", readonly(w.clock.time()))
    await w.after(0.25)
    [drained] = w.events
    assert isinstance(drained, NodeDrained) and drained.severity is Severity.WARNING
    assert (drained.cause, drained.by) == ("nvme.readonly:node-1:nvme0n1", "ringmaster")
    assert drained.evidence == "nvme0n1 read-only (ro=1)"
    node = w.registry.nodes["node-1"]
    assert node.state is NodeState.DRAINING and node.drained_by == "ringmaster"
    assert node.slurm_cause == ("nvme.readonly:node-1:nvme0n1", "nvme0n1 read-only (ro=1)")
    for _ in range(4):
        w.beat("node-1", readonly(0.0))
        await w.after(1.0)
    assert len(w.events) == 1  # said once
    w.beat("node-1")  # writable again
    await w.after(1.0)
    assert node.state is NodeState.DRAINING and node.probation_until is not None
    assert node.drain_reason.startswith("probation after nvme.readonly: takes work at")
    await w.after(PROBATION_S["nvme.readonly"] - 1.0)
    assert node.state is NodeState.DRAINING
    await w.after(1.0)  # the probation passed: looked at on every tick, no beat needed
    assert node.state is NodeState.READY and node.healthy and node.slurm_cause is None
    returned = w.events[-1]
    assert isinstance(returned, NodeReturned) and returned.probation_s == 300.0
    assert returned.evidence.startswith("nvme.readonly:node-1:nvme0n1 closed (nvme0n1 read-only")
    assert w.kinds() == ["node.drained", "node.returned"]


async def test_a_new_leader_changes_nothing_that_is_right() -> None:
    w = World()
    await w.keeper.load()
    w.beat("node-1", readonly(w.clock.time()))
    await w.after(0.0)
    assert w.kinds() == ["node.drained"]
    # a standby takes over: its registry heard the same beats, its store is the same
    successor = World(w.store)
    successor.clock = w.clock
    successor.keeper = successor.new_keeper()
    successor.beat("node-1", readonly(0.0))
    await successor.keeper.load()
    assert successor.registry.nodes["node-1"].state is NodeState.DRAINING  # at once
    await successor.after(1.0)
    assert successor.events == []
    # a node first heard after the takeover gets its record's view before any tick
    late = World(w.store)
    late.clock = w.clock
    late.keeper = late.new_keeper()
    await late.keeper.load()
    late.beat("node-1")  # the device came back meanwhile
    assert late.registry.nodes["node-1"].state is NodeState.DRAINING
    await late.after(0.0)
    assert late.keeper.lives["node-1"].phase is Phase.PROBATION and late.events == []


async def test_a_deposed_leaders_step_stops_at_the_store() -> None:
    w = World()
    await w.keeper.load()
    w.beat("node-1")
    await w.after(0.0)
    other = LifeStore(w.store)  # the successor, which writes the record meanwhile
    assert await other.load() == {}  # nothing to say of the node: nothing written
    await w.keeper.control(NodeControl(node="node-1", action="cordon", by="bob"))
    life = (await other.load())["node-1"]
    life.cordon = None
    await other.save(life)
    w.beat("node-1", readonly(w.clock.time()))
    await w.after(1.0)
    assert w.kinds() == ["node.cordoned"]  # the drain was not said: the save lost
    assert w.keeper.lives["node-1"].cordon is None  # the successor's record taken


async def test_the_operators_verbs_and_their_refusals() -> None:
    w = World()
    await w.keeper.load()
    w.beat("node-1")
    await w.after(0.0)
    nobody = await w.keeper.control(NodeControl(node="node-9", action="cordon"))
    assert not nobody.ok and nobody.error == "no node 'node-9'"
    bare = await w.keeper.control(NodeControl(node="node-1", action="drain", reason=" "))
    assert not bare.ok and bare.error.startswith("drain needs a reason")

    cordon = await w.keeper.control(NodeControl(node="node-1", action="cordon", by="bob"))
    node = w.registry.nodes["node-1"]
    assert cordon.ok and node.cordoned_by == "bob" and not node.healthy
    assert node.state is NodeState.READY
    again = await w.keeper.control(NodeControl(node="node-1", action="cordon", by="bob"))
    assert again.ok and again.note == "already cordoned by bob"

    drain = NodeControl(node="node-1", action="drain", reason="disk swap", by="alice")
    assert (await w.keeper.control(drain)).ok
    assert w.evacuated == [("node-1", "drained by alice: disk swap")]
    assert node.state is NodeState.DRAINING and node.drained_by == "alice"
    assert node.slurm_cause == ("operator", "disk swap")
    await w.after(3600.0)
    assert node.state is NodeState.DRAINING  # never lifted by Ringmaster

    w.beat("node-1", readonly(w.clock.time()))
    await w.after(1.0)
    refused = await w.keeper.control(NodeControl(node="node-1", action="undrain", by="alice"))
    assert not refused.ok and refused.error.startswith("node-1: it stays drained for nvme.readonly")
    assert node.cordoned_by == "" and node.state is NodeState.DRAINING
    w.beat("node-1")
    await w.after(1.0)
    assert (await w.keeper.control(NodeControl(node="node-1", action="undrain", by="al"))).ok
    assert node.state is NodeState.READY and node.healthy
    said = [(kind_of(e), getattr(e, "by", "")) for e in w.events]
    assert said == [
        ("node.cordoned", "bob"),
        ("node.drained", "alice"),
        ("node.cordoned", "alice"),
        ("node.returned", "al"),
    ], said
    lifted = w.events[2]
    assert isinstance(lifted, NodeCordoned) and not lifted.cordoned


async def test_three_faults_of_a_kind_hold_the_node_for_a_person() -> None:
    w = World()
    await w.keeper.load()
    for _ in range(3):
        w.beat("node-1", readonly(w.clock.time()))
        await w.after(1.0)
        w.beat("node-1")
        await w.after(1.0)
    held = w.events[-1]
    assert isinstance(held, NodeDrained) and held.held and held.severity is Severity.CRITICAL
    assert held.history.startswith("nvme.readonly 3 times within 60 min")
    node = w.registry.nodes["node-1"]
    await w.after(3 * 3600.0)
    assert node.state is NodeState.DRAINING and node.held
    assert (await w.keeper.control(NodeControl(node="node-1", action="undrain"))).ok
    assert node.state is NodeState.READY and not node.held


async def test_a_judged_clock_and_a_loss_drain_while_they_last() -> None:
    w = World()
    await w.keeper.load()
    clock = Condition(kind=ConditionKind.CLOCK, node="node-1", value=9.5, since=w.clock.time())
    w.beat("node-1", clock)
    await w.after(0.0)
    assert w.events == []  # a warning degrades, drains nothing
    w.registry.drain("node-1", clock.key, "clock still +9.5 ms off after a resync")
    await w.after(0.0)
    [drained] = w.events
    assert isinstance(drained, NodeDrained) and drained.cause == clock.key
    w.beat("node-1")
    await w.after(1.0)
    assert w.keeper.lives["node-1"].phase is Phase.PROBATION
    await w.after(PROBATION_S["clock.drift"])
    assert w.kinds() == ["node.drained", "node.returned"]

    w.registry.nodes["node-1"].state = NodeState.AWAY
    w.registry.declare_lost("node-1", "the ranks of j-1 stopped stepping")
    await w.after(0.0)
    lost = w.events[-1]
    assert isinstance(lost, NodeDrained) and lost.cause == "node.lost"
    assert lost.evidence == "the ranks of j-1 stopped stepping"
    assert w.registry.nodes["node-1"].slurm_cause == ("node.lost", lost.evidence)
    w.beat("node-1")  # back: on probation, not admitted yet
    await w.after(1.0)
    assert w.registry.nodes["node-1"].state is NodeState.DRAINING
    await w.after(PROBATION_S["node.lost"])
    assert w.registry.nodes["node-1"].state is NodeState.READY


async def test_the_coordinators_hold_on_a_nodes_numbers_is_taken_once_until_undrain() -> None:
    w = World()
    await w.keeper.load()
    w.beat("node-1")
    await w.after(0.0)
    w.registry.hold("node-1", "the ranks of node-1 alone computed non-finite values 3 times")
    await w.after(0.25)
    [held] = w.events
    assert isinstance(held, NodeDrained) and held.held and held.severity is Severity.CRITICAL
    assert (held.cause, held.by) == ("numeric", "ringmaster")
    assert held.history == held.evidence and "3 times" in held.evidence
    node = w.registry.nodes["node-1"]
    assert node.hold_for == "" and node.state is NodeState.DRAINING and node.held
    assert node.slurm_cause == ("held", held.evidence)
    w.beat("node-1")
    await w.after(3 * 3600.0)  # its gate passes all along: held still, said once
    assert len(w.events) == 1 and node.held
    assert (await w.keeper.control(NodeControl(node="node-1", action="undrain"))).ok
    assert node.state is NodeState.READY and w.kinds() == ["node.drained", "node.returned"]


async def test_a_notice_that_passes_returns_the_node_saying_so() -> None:
    w = World()
    await w.keeper.load()
    message = "aws preemption notice: terminate at 10:00:20 UTC, in 20 s (x)"
    notice = Condition(
        kind=ConditionKind.PREEMPTION,
        node="node-1",
        subject="aws",
        severity=Severity.CRITICAL,
        since=w.clock.time(),
        reason=message,
    )
    w.beat("node-1", notice)
    await w.after(0.25)
    w.beat("node-1")  # its agent closed it: the deadline went by with the node up
    await w.after(80.0)
    node = w.registry.nodes["node-1"]
    assert node.state is NodeState.DRAINING and node.serving_since is None
    await w.after(PROBATION_S["spot.notice"])
    drained, returned = w.events
    assert isinstance(drained, NodeDrained) and isinstance(returned, NodeReturned)
    assert returned.cause == notice.key == "spot.notice:node-1:aws"
    assert returned.evidence == (
        f"spot.notice:node-1:aws passed with the node still up ({message}); its health gate "
        "passed for 60 s"
    )
    assert node.state is NodeState.READY and node.serving_since == w.clock.time()
    assert [f.key for f in w.keeper.lives["node-1"].faults] == [notice.key]  # its history
