"""Admission and the rendezvous plan: pure functions over registry entries; the registry's
mirror of what the beats say."""

from __future__ import annotations

from coordinator.registry import NodeInfo, Registry
from coordinator.rendezvous import admit, cpu_slice, plan
from proto.codec import encode, node_beat_decoder
from proto.conditions import Condition, ConditionKind, Severity
from proto.node import GpuSample, Heartbeat, NodeState, RankReport, Telemetry


def node(i: int, *conditions: Condition, **kw: object) -> NodeInfo:
    info = NodeInfo(id=f"node-{i}", addr=f"10.0.0.{i + 1}", gpus=8, **kw)  # type: ignore[arg-type]
    info.conditions = {c.key: c for c in conditions}
    return info


def test_admission_takes_healthy_nodes_in_id_order_and_explains_skips() -> None:
    preflight = Condition(
        kind=ConditionKind.PREFLIGHT,
        node="node-1",
        reason="preflight failed: shm_size 0.1 GB (want >= 8 GB)",
    )
    link = Condition(kind=ConditionKind.TOPOLOGY, node="node-2", subject="0-1")
    nodes = [node(3), node(1, preflight), node(0), node(2, link), node(4)]
    adm = admit(nodes, 2, 8, busy={"node-4"}, exclude={})
    assert [n.id for n in adm.chosen] == ["node-0", "node-3"]
    assert adm.skipped == {
        "node-1": "preflight failed",
        "node-2": "GPU topology degraded",
        "node-4": "busy with another job",
    }


def test_admission_is_all_or_nothing() -> None:
    adm = admit([node(0), node(1, state=NodeState.LOST)], 2, 1, set(), {})
    assert adm.chosen == []
    assert adm.skipped == {"node-1": "node is lost"}


def test_admission_refuses_excluded_and_too_small_nodes() -> None:
    adm = admit([node(0), node(1)], 1, 16, set(), exclude={"node-0": "left out after a fault"})
    assert adm.skipped["node-0"] == "left out after a fault"
    assert "needs 16" in adm.skipped["node-1"]


def test_plan_matches_torchrun_environment_with_contiguous_ranks() -> None:
    plans = plan([node(0), node(1)], 4, 29500, {"NCCL_DEBUG": "WARN"})
    assert [p.node for p in plans] == ["node-0", "node-1"]
    assert [r.rank for r in plans[1].ranks] == [4, 5, 6, 7]
    assert [r.local_rank for r in plans[1].ranks] == [0, 1, 2, 3]
    env = plans[1].env
    assert env["MASTER_ADDR"] == "10.0.0.1"  # node 0's IP, never a hostname
    assert env["MASTER_PORT"] == "29500"
    assert env["WORLD_SIZE"] == "8" and env["LOCAL_WORLD_SIZE"] == "4"
    assert env["GROUP_RANK"] == "1" and env["NCCL_DEBUG"] == "WARN"


def test_cpu_affinity_splits_cores_evenly_or_not_at_all() -> None:
    assert cpu_slice(1, 4, 32) == list(range(8, 16))
    assert cpu_slice(0, 4, 2) == []
    assert cpu_slice(0, 1, 0) == []


def test_registry_marks_away_after_three_missed_beats_then_lost_past_the_grace() -> None:
    """A silent node is away after three beats (an agent restarting is back well within
    the grace, and no page); one hosting no running rank is lost past the grace."""
    reg = Registry(missed_beats=3, away_grace_s=15.0)
    beat = Heartbeat(node="node-0", seq=1, sent_at=0.0, interval_s=1.0)
    _, fresh = reg.observe(beat, now=100.0)
    assert fresh
    assert reg.sweep(now=102.9) == ([], [])
    [away], [] = reg.sweep(now=103.1)
    assert away.state is NodeState.AWAY
    assert reg.sweep(now=110.0) == ([], [])  # said once
    _, fresh = reg.observe(beat, now=111.0)  # an agent restart: back, not a new node
    assert not fresh and reg.nodes["node-0"].state is NodeState.READY
    reg.sweep(now=114.5)
    [], [lost] = reg.sweep(now=126.5)
    assert lost.state is NodeState.LOST and reg.sweep(now=200.0) == ([], [])
    _, fresh = reg.observe(beat, now=201.0)
    assert fresh and reg.nodes["node-0"].state is NodeState.READY


def test_a_sweep_finds_every_silent_node_whatever_order_and_interval_they_beat_in() -> None:
    """The sweep reads only the least recently heard nodes: whatever the order of beats
    and the intervals (a slow-beating node is not silent at a fast one's threshold), it
    finds exactly the silent ones."""
    reg = Registry(missed_beats=3, away_grace_s=15.0)

    def beat(node: str, now: float, interval_s: float = 1.0) -> None:
        reg.observe(Heartbeat(node=node, seq=1, sent_at=now, interval_s=interval_s), now=now)

    for i in range(6):
        beat(f"n{i}", 0.0)
    beat("slow", 0.0, interval_s=5.0)
    for t in (1.0, 2.0, 3.0, 4.0):
        for i in (5, 3, 1):  # n0, n2, n4 fell silent at 0; the others beat, out of order
            beat(f"n{i}", t)
    away, _ = reg.sweep(now=4.5)
    assert {n.id for n in away} == {"n0", "n2", "n4"}  # not "slow": 4.5 s < 3 × 5 s
    beat("n0", 5.0)  # back: no longer at the silent front
    away, lost = reg.sweep(now=16.0)
    assert {n.id for n in away} == {"n1", "n3", "n5", "slow", "n0"}
    assert {n.id for n in lost} == {"n2", "n4", "slow"}  # silent past the 15 s grace
    beat("n2", 17.0)  # a lost node back: heard again, and found again once silent
    away, lost = reg.sweep(now=20.5)
    assert [n.id for n in away] == ["n2"]
    assert {n.id for n in lost} == {"n0", "n1", "n3", "n5"}  # away past the grace


def test_an_away_node_is_kept_while_a_job_vouches_for_it_else_lost_past_the_grace() -> None:
    """An away node whose job shows its ranks stepping stays away; its job's verdict can
    declare it lost at once; a node nobody vouches for (a dead one whose job restarted
    elsewhere, its last beat still listing ranks) is lost past the grace."""
    reg = Registry(missed_beats=3, away_grace_s=15.0)
    rank = RankReport(job="j", rank=1, attempt=1, pid=42, alive=True)
    for node in ("n", "dead"):
        beat = Heartbeat(node=node, seq=1, sent_at=0.0, interval_s=1.0, ranks=[rank])
        reg.observe(beat, now=0.0)
    away, [] = reg.sweep(now=3.5)
    assert {n.id for n in away} == {"n", "dead"}
    reg.vouch("n", now=10.0)
    [], [dead] = reg.sweep(now=16.0)
    assert dead.id == "dead" and dead.lost_reason == "no job's ranks step there"
    [node] = [n for n in away if n.id == "n"]
    assert reg.declare_lost("n", "the ranks of j stopped stepping") is node
    assert node.state is NodeState.LOST
    assert reg.declare_lost("n", "again") is None  # once
    assert reg.sweep(now=17.0) == ([], [node]) and node.lost_reason.startswith("the ranks")


def spike(since: float, active: bool = True) -> Condition:
    return Condition(
        kind=ConditionKind.NVME_LATENCY,
        node="n",
        subject="nvme0n1",
        since=since,
        active=active,
        reason="nvme0n1 latency 900 µs above 100 µs",
    )


def test_conditions_degrade_a_node_until_they_close() -> None:
    reg = Registry()
    reg.observe(Heartbeat(node="n", seq=1, sent_at=0.0), now=0.0)
    reg.observe_condition(spike(since=1.0))
    node = reg.nodes["n"]
    assert node.state is NodeState.DEGRADED and not node.healthy
    assert node.why_not_healthy() == "nvme0n1 latency 900 µs above 100 µs"
    reg.observe_condition(spike(since=2.0, active=False))
    assert reg.nodes["n"].state is NodeState.READY


def test_warnings_alone_leave_a_node_ready_and_eligible() -> None:
    """A node with only advisory conditions (preflight warnings, a clock unsynchronised
    but in bounds) is ready and admitted, and still shows them; a required preflight check
    failing (the same kind at warning) refuses it."""
    warned = Condition(
        kind=ConditionKind.PREFLIGHT,
        node="node-0",
        severity=Severity.INFO,
        reason="preflight passed with warnings: somaxconn 4096 (want >= 65535)",
    )
    clock = Condition(
        kind=ConditionKind.CLOCK,
        node="node-0",
        severity=Severity.INFO,
        reason="clock unsynchronised (offset +0.10 ms)",
    )
    failed = Condition(
        kind=ConditionKind.PREFLIGHT,
        node="node-1",
        reason="preflight failed: shm_size 0.1 GB (want >= 8 GB); warning: somaxconn 4096 "
        "(want >= 65535)",
    )
    reg = Registry()
    reg.observe(Heartbeat(node="node-0", seq=1, sent_at=0.0, conditions=[warned, clock]), 0.0)
    reg.observe(Heartbeat(node="node-1", seq=1, sent_at=0.0, conditions=[failed]), 0.0)
    ok, refused = reg.nodes["node-0"], reg.nodes["node-1"]
    assert ok.state is NodeState.READY and ok.healthy and ok.preflight_ok
    assert set(ok.conditions) == {warned.key, clock.key}, "still shown"
    assert refused.state is NodeState.DEGRADED and not refused.preflight_ok
    adm = admit([ok, refused], 1, 1, busy=set(), exclude={})
    assert [n.id for n in adm.chosen] == ["node-0"]
    assert adm.skipped == {"node-1": "preflight failed"}
    assert admit([ok, refused], 2, 1, busy=set(), exclude={}).chosen == [], "one is refused"
    reg.observe_condition(
        Condition(kind=ConditionKind.PREFLIGHT, node="node-0", since=1.0, reason="failed")
    )
    assert not ok.preflight_ok and ok.state is NodeState.DEGRADED
    assert ok.why_not_healthy() == "failed", "advisory reasons are no reason to refuse"


def test_heartbeats_are_the_authoritative_set() -> None:
    """A beat replaces the mirror (a lost event heals on the next beat), except for an
    event newer than the beat, which stands until a beat sent after it arrives."""
    reg = Registry()
    reg.observe(Heartbeat(node="n", seq=1, sent_at=0.0, conditions=[spike(0.5)]), now=0.0)
    assert list(reg.nodes["n"].conditions) == [spike(0.5).key]  # no event was needed
    reg.observe_condition(spike(since=3.0, active=False))  # the close overtakes beat 2
    reg.observe(Heartbeat(node="n", seq=2, sent_at=2.9, conditions=[spike(0.5)]), now=1.0)
    assert reg.nodes["n"].conditions == {} and reg.nodes["n"].state is NodeState.READY
    reg.observe(Heartbeat(node="n", seq=3, sent_at=3.5), now=2.0)
    assert reg.nodes["n"].conditions == {}
    reg.observe_condition(spike(since=4.0))  # opened; the next beat, sent later, agrees
    reg.observe(Heartbeat(node="n", seq=4, sent_at=4.5, conditions=[spike(4.0)]), now=3.0)
    assert reg.nodes["n"].state is NodeState.DEGRADED
    reg.observe(Heartbeat(node="n", seq=5, sent_at=5.5), now=4.0)  # closed, event lost
    assert reg.nodes["n"].state is NodeState.READY


def test_a_repeated_beat_restores_what_an_older_event_changed() -> None:
    """The mirror is made anew only when a beat's conditions differ from the beat's
    before, or an event changed it since: a late close (older than the newest beat) is
    undone by the next beat, which still lists the condition."""
    reg = Registry()
    reg.observe(Heartbeat(node="n", seq=1, sent_at=2.0, conditions=[spike(0.5)]), now=0.0)
    reg.observe_condition(spike(since=1.0, active=False))  # sent before beat 1
    assert reg.nodes["n"].conditions == {}
    reg.observe(Heartbeat(node="n", seq=2, sent_at=3.0, conditions=[spike(0.5)]), now=1.0)
    assert list(reg.nodes["n"].conditions) == [spike(0.5).key]
    assert reg.nodes["n"].state is NodeState.DEGRADED


def test_telemetry_is_read_when_asked_for_and_a_malformed_one_loses_no_beat() -> None:
    """The coordinator reads a beat as ``NodeBeat``: its telemetry is decoded when a node
    record needs it. Telemetry that does not decode leaves the beat counted (the node is
    alive) and the record without telemetry, the reason named."""
    reg = Registry()
    good = Heartbeat(
        node="n", seq=1, sent_at=1.0, telemetry=Telemetry(gpus=(GpuSample(index=0, temp_c=61.0),))
    )
    node, _ = reg.observe(node_beat_decoder.decode(encode(good)), now=0.0)
    assert node.telemetry == good.telemetry and node.telemetry_error == ""
    bad = encode(good).replace(b'"gpus":[{', b'"gpus":[{"temp_c":"hot",', 1)
    node, _ = reg.observe(node_beat_decoder.decode(bad), now=5.0)
    assert node.last_seen == 5.0 and node.state is NodeState.READY
    assert node.telemetry == Telemetry()
    assert "telemetry is malformed" in node.telemetry_error and "temp_c" in node.telemetry_error
    node, _ = reg.observe(node_beat_decoder.decode(encode(good)), now=6.0)
    assert node.telemetry == good.telemetry and node.telemetry_error == ""


def test_a_node_its_life_drains_stays_draining_whatever_its_conditions() -> None:
    reg = Registry()
    reg.observe(Heartbeat(node="n", seq=1, sent_at=0.0), now=0.0)
    reg.nodes["n"].drain_reason = "clock still 9.5 ms off after a resync"  # the keeper's
    reg.observe(Heartbeat(node="n", seq=2, sent_at=1.0), now=1.0)
    assert reg.nodes["n"].state is NodeState.DRAINING
    assert reg.nodes["n"].why_not_healthy() == "clock still 9.5 ms off after a resync"
    reg.nodes["n"].drain_reason = ""  # its life returns it
    reg.observe(Heartbeat(node="n", seq=3, sent_at=2.0), now=2.0)
    assert reg.nodes["n"].state is NodeState.READY


def test_a_judged_drain_lasts_while_its_condition_is_open_and_nodes_changed_are_noted() -> None:
    clock = Condition(kind=ConditionKind.CLOCK, node="n", value=9.5, since=0.5)
    reg = Registry()
    reg.observe(Heartbeat(node="n", seq=1, sent_at=0.0), now=0.0)
    assert reg.touched == {"n"}
    reg.touched.clear()
    reg.drain("n", clock.key, "still 9.5 ms off")  # not open: nothing to drain for
    assert reg.nodes["n"].judged == {} and reg.touched == set()
    reg.observe(Heartbeat(node="n", seq=2, sent_at=1.0, conditions=(clock,)), now=1.0)
    reg.drain("n", clock.key, "still 9.5 ms off")
    assert reg.nodes["n"].judged == {clock.key: "still 9.5 ms off"} and reg.touched == {"n"}
    reg.touched.clear()
    reg.observe(Heartbeat(node="n", seq=3, sent_at=2.0, conditions=(clock,)), now=2.0)
    assert reg.touched == set()  # the same beat again: nothing changed


def test_a_cordoned_node_is_not_admitted() -> None:
    reg = Registry()
    reg.observe(Heartbeat(node="n", seq=1, sent_at=0.0), now=0.0)
    reg.nodes["n"].cordoned_by = "alice"
    assert not reg.nodes["n"].healthy and reg.nodes["n"].state is NodeState.READY
    adm = admit(list(reg.nodes.values()), 1, 1, set(), {})
    assert adm.chosen == [] and adm.skipped == {"n": "cordoned by alice"}


def test_silence_while_the_bus_is_out_is_not_node_loss() -> None:
    reg = Registry(missed_beats=3, bus_outage_s=1.5)
    for node in ("node-0", "node-1"):
        reg.observe(Heartbeat(node=node, seq=1, sent_at=0.0, interval_s=1.0), now=0.0)
    reg.bus_alive(0.0)
    reg.bus_alive(1.0)
    assert reg.sweep(now=2.0) == ([], [])
    # the server freezes for 20 s: no beat and no canary gets through
    assert reg.bus_out(now=20.0) and reg.sweep(now=20.0) == ([], [])
    reg.bus_alive(20.0)  # back: every node gets a fresh window
    reg.observe(Heartbeat(node="node-0", seq=2, sent_at=21.0, interval_s=1.0), now=21.0)
    for t in (21.0, 22.0):
        reg.bus_alive(t)
    assert not reg.bus_out(22.9) and reg.sweep(now=22.9) == ([], [])  # 2.9 s since the outage
    reg.bus_alive(23.0)
    [away], [] = reg.sweep(now=23.1)  # node-1 stayed silent with the bus up: that is evidence
    assert away.id == "node-1"


def test_silent_nodes_are_those_quiet_for_one_and_a_half_beats() -> None:
    reg = Registry()
    for node, at in (("node-0", 10.0), ("node-1", 8.4), ("node-2", 8.6)):
        reg.observe(Heartbeat(node=node, seq=1, sent_at=at, interval_s=1.0), now=at)
    assert reg.silent(["node-0", "node-1", "node-2", "node-7"], now=10.0) == {"node-1", "node-7"}
    reg.bus_alive(0.0)
    assert reg.silent(["node-1"], now=10.0) == frozenset()  # the bus is out: no evidence
