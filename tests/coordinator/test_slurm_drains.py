"""The Slurm decisions (pure): drains set and lifted exactly with each node's life, jobs
whose allocation is gone; and the parsing of Slurm's node table."""

from __future__ import annotations

import pytest

from coordinator import node_life, node_verbs
from coordinator.node_keeper import NodeKeeper, evidence
from coordinator.registry import NodeInfo
from coordinator.slurm_drains import Drain, Lift, SlurmDrains, plan
from coordinator.slurm_jobs import gone
from proto.conditions import Condition, ConditionKind, Severity
from proto.job import Allocation, JobRecord, JobSection, JobSpec, JobState
from proto.node import NodeState
from proto.node_life import NodeLife
from ringmaster import slurm as slurm_commands
from ringmaster.slurm import SlurmNode, parse_nodes

pytestmark = pytest.mark.anyio

READONLY = Condition(
    kind=ConditionKind.NVME_READONLY,
    node="node-1",
    subject="nvme0n1",
    severity=Severity.CRITICAL,
    reason="nvme0n1 read-only (sysfs ro=1)",
)


def node(
    name: str,
    *conds: Condition,
    state: NodeState = NodeState.READY,
    life: NodeLife | None = None,
    lost_reason: str = "",
) -> NodeInfo:
    """A node as the registry holds it, its life brought up to its evidence."""
    n = NodeInfo(id=name, hostname=f"{name}.cluster.example", state=state)
    n.conditions, n.lost_reason = {c.key: c for c in conds}, lost_reason
    life, _ = node_life.step(life or NodeLife(node=name), evidence(n), 0.0)
    NodeKeeper._show(n, life, 0.0)
    return n


def slurm(**states: tuple[str, str]) -> dict[str, SlurmNode]:
    return {
        name.replace("_", "-"): SlurmNode(name.replace("_", "-"), *s) for name, s in states.items()
    }


def test_a_critical_hardware_condition_drains_with_its_key_and_evidence() -> None:
    known = slurm(node_0=("idle", ""), node_1=("allocated", ""))
    changes = plan([node("node-0"), node("node-1", READONLY)], known, {})
    reason = "ringmaster: nvme.readonly:node-1:nvme0n1: nvme0n1 read-only (sysfs ro=1)"
    assert changes == [Drain("node-1", "nvme.readonly:node-1:nvme0n1", reason)]


def test_warnings_are_no_drain_and_a_notice_drains_while_it_stands() -> None:
    warm = Condition(kind=ConditionKind.GPU_THERMAL, node="node-0", subject="0")
    assert plan([node("node-0", warm)], slurm(node_0=("idle", "")), {}) == []
    notice = Condition(
        kind=ConditionKind.PREEMPTION,
        node="node-0",
        subject="aws",
        severity=Severity.CRITICAL,
        reason="aws: terminate",
    )
    [drain] = plan([node("node-0", notice)], slurm(node_0=("idle", "")), {})
    assert drain.reason == "ringmaster: spot.notice:node-0:aws: aws: terminate"


def test_a_node_on_probation_stays_drained_and_is_lifted_once_it_serves() -> None:
    drained = node("node-1", READONLY)
    known = slurm(node_1=("drained", f"ringmaster: {READONLY.key}: ro"))
    assert plan([drained], known, {}) == []
    life, _ = node_life.step(NodeLife(node="node-1"), evidence(drained), 0.0)
    healed = NodeInfo(id="node-1")
    life, _ = node_life.step(life, evidence(healed), 10.0)  # closed: on probation
    NodeKeeper._show(healed, life, 10.0)
    assert healed.state is NodeState.DRAINING and plan([healed], known, {}) == []
    life, _ = node_life.step(life, evidence(healed), 10.0 + 300.0)
    NodeKeeper._show(healed, life, 310.0)
    assert plan([healed], known, {}) == [Lift("node-1", f"ringmaster: {READONLY.key}: ro")]


def test_an_operators_drain_says_so_in_slurm() -> None:
    life, _, _ = node_verbs.command(NodeLife(node="node-0"), "drain", "alice", "disk swap", 0.0)
    [drain] = plan([node("node-0", life=life)], slurm(node_0=("idle", "")), {})
    assert drain == Drain("node-0", "operator", "ringmaster: operator: disk swap")


async def test_someone_elses_drain_is_shown_beside_the_node_and_never_touched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    known = slurm(node_0=("drained", "admin: fan check"), node_1=("idle", ""))
    monkeypatch.setattr(slurm_commands, "nodes", lambda: known)
    changed: list[tuple[str, ...]] = []
    monkeypatch.setattr(slurm_commands, "drain", lambda *a: changed.append(("drain", *a)))
    monkeypatch.setattr(slurm_commands, "lift", lambda *a: changed.append(("lift", *a)))
    nodes = [node("node-0"), node("node-1")]

    async def publish(event: object) -> None:
        pass

    await SlurmDrains(lambda: nodes, publish).reconcile()
    assert [n.slurm_drain for n in nodes] == ["admin: fan check", ""] and changed == []


def test_a_lost_node_is_drained_and_an_away_one_is_left_alone() -> None:
    lost = node("node-0", state=NodeState.LOST, lost_reason="the ranks of j-1 stopped stepping")
    away = node("node-1", READONLY, state=NodeState.AWAY)
    known = slurm(node_0=("down*", ""), node_1=("drained", "ringmaster: x: y"))
    [drain] = plan([lost, away], known, {})
    assert drain == Drain(
        "node-0", "node.lost", "ringmaster: node.lost: the ranks of j-1 stopped stepping"
    )


def test_only_our_drain_is_lifted_once_the_node_reports_healthy() -> None:
    known = slurm(node_0=("drained", "ringmaster: nvme.readonly:node-0:nvme0n1: ro"))
    known |= slurm(node_1=("draining", "admin: fan replaced, burn-in"))
    changes = plan([node("node-0"), node("node-1")], known, {})
    assert changes == [Lift("node-0", "ringmaster: nvme.readonly:node-0:nvme0n1: ro")]


def test_a_drain_fires_once_per_fault_even_when_someone_lifts_it() -> None:
    known = slurm(node_1=("idle", ""))
    key = "nvme.readonly:node-1:nvme0n1"
    assert plan([node("node-1", READONLY)], known, {"node-1": key}) == []
    other = Condition(
        kind=ConditionKind.TOPOLOGY, node="node-1", subject="0-1", severity=Severity.CRITICAL
    )
    [again] = plan([node("node-1", other)], known, {"node-1": key})
    assert isinstance(again, Drain) and again.key == "topology.degraded:node-1:0-1"


def test_nodes_are_matched_by_id_then_short_hostname_and_unknown_ones_skipped() -> None:
    known = {"gpu-07": SlurmNode("gpu-07", "idle", "")}
    by_host = node("rack3-07", READONLY)
    by_host.hostname = "gpu-07.cluster.example"
    stranger = node("node-9", READONLY)
    assert [c.node for c in plan([by_host, stranger], known, {})] == ["gpu-07"]


def test_sinfo_lines_parse_with_reasons_that_hold_the_separator() -> None:
    text = (
        "node-0|idle|none\n"
        "node-1|drained|ringmaster: gpu.xid:node-1:0: Xid 79 | fallen off the bus\n"
        "node-1|drained|ringmaster: gpu.xid:node-1:0: Xid 79 | fallen off the bus\n"
        "garbage\n"
        "node-2|mixed+drain|admin\n"
    )
    nodes = parse_nodes(text)
    assert sorted(nodes) == ["node-0", "node-1", "node-2"]
    assert nodes["node-0"].reason == "" and not nodes["node-0"].drained
    assert nodes["node-1"].reason.endswith("| fallen off the bus") and nodes["node-1"].ours
    assert nodes["node-2"].drained and not nodes["node-2"].ours


def test_a_live_job_whose_allocation_no_longer_holds_its_nodes_is_stopped() -> None:
    def job(job_id: str, slurm_job: str, state: JobState = JobState.RUNNING) -> JobRecord:
        return JobRecord(
            id=job_id,
            name="j",
            spec=JobSpec(job=JobSection(name="j")),
            state=state,
            allocation=Allocation(job_id=slurm_job, hosts=["node-0"]),
        )

    jobs = [
        job("a", "7"),
        job("b", "8"),
        job("c", "9", JobState.STOPPED),
        job("d", "10"),
        JobRecord(id="e", name="j", spec=JobSpec(job=JobSection(name="j"))),
    ]
    states = {"7": "RUNNING", "8": "CANCELLED", "9": "FAILED", "10": "GONE"}
    assert gone(jobs, states) == [
        ("b", "Slurm job 8 is CANCELLED: its allocation is gone"),
        ("d", "Slurm job 10 is GONE: its allocation is gone"),
    ]
    assert gone(jobs, {}) == []  # unknown (Slurm did not answer) is not gone
