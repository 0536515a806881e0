"""Admission and the rendezvous plan: pure functions over registry entries."""

from __future__ import annotations

from coordinator.registry import NodeInfo, Registry
from coordinator.rendezvous import admit, cpu_slice, plan
from proto.node import Heartbeat, NodeState


def node(i: int, **kw: object) -> NodeInfo:
    return NodeInfo(id=f"node-{i}", addr=f"10.0.0.{i + 1}", gpus=8, **kw)  # type: ignore[arg-type]


def test_admission_takes_healthy_nodes_in_id_order_and_explains_skips() -> None:
    nodes = [node(3), node(1, preflight_ok=False), node(0), node(2, topology_ok=False), node(4)]
    adm = admit(nodes, 2, 8, busy={"node-4"}, exclude=set())
    assert [n.id for n in adm.chosen] == ["node-0", "node-3"]
    assert adm.skipped == {
        "node-1": "preflight failed",
        "node-2": "GPU topology degraded",
        "node-4": "busy with another job",
    }


def test_admission_is_all_or_nothing() -> None:
    adm = admit([node(0), node(1, state=NodeState.LOST)], 2, 1, set(), set())
    assert adm.chosen == []
    assert adm.skipped == {"node-1": "node is lost"}


def test_admission_refuses_excluded_and_too_small_nodes() -> None:
    adm = admit([node(0), node(1)], 1, 16, set(), exclude={"node-0"})
    assert adm.skipped["node-0"].startswith("excluded")
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


def test_registry_marks_lost_after_three_missed_beats_and_revives() -> None:
    reg = Registry(missed_beats=3)
    beat = Heartbeat(node="node-0", seq=1, sent_at=0.0, interval_s=1.0)
    _, fresh = reg.observe(beat, now=100.0)
    assert fresh
    assert reg.sweep(now=102.9) == []
    [lost] = reg.sweep(now=103.1)
    assert lost.state is NodeState.LOST
    assert reg.sweep(now=110.0) == []  # reported once
    _, fresh = reg.observe(beat, now=111.0)
    assert fresh and reg.nodes["node-0"].state is NodeState.READY


def test_faults_degrade_a_node_until_they_clear() -> None:
    reg = Registry()
    reg.observe(Heartbeat(node="n", seq=1, sent_at=0.0), now=0.0)
    reg.set_fault("n", "nvme:nvme0n1", "spike")
    assert reg.nodes["n"].state is NodeState.DEGRADED and not reg.nodes["n"].healthy
    reg.set_fault("n", "nvme:nvme0n1", None)
    assert reg.nodes["n"].state is NodeState.READY
