"""The Slurm decisions (pure): drains and their lifting, jobs whose allocation is gone;
and the parsing of Slurm's node table."""

from __future__ import annotations

from coordinator.registry import NodeInfo
from coordinator.slurm_drains import Drain, Lift, plan
from coordinator.slurm_jobs import gone
from proto.conditions import Condition, ConditionKind, Severity
from proto.job import Allocation, JobRecord, JobSection, JobSpec, JobState
from proto.node import NodeState
from ringmaster.slurm import SlurmNode, parse_nodes

READONLY = Condition(
    kind=ConditionKind.NVME_READONLY,
    node="node-1",
    subject="nvme0n1",
    severity=Severity.CRITICAL,
    reason="nvme0n1 read-only (sysfs ro=1)",
)


def node(name: str, *conds: Condition, state: NodeState = NodeState.READY) -> NodeInfo:
    n = NodeInfo(id=name, hostname=f"{name}.cluster.example", state=state)
    n.conditions = {c.key: c for c in conds}
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


def test_warnings_and_notices_are_no_drain() -> None:
    warm = Condition(kind=ConditionKind.GPU_THERMAL, node="node-0", subject="0")
    notice = Condition(
        kind=ConditionKind.PREEMPTION, node="node-0", subject="aws", severity=Severity.CRITICAL
    )
    assert plan([node("node-0", warm, notice)], slurm(node_0=("idle", "")), {}) == []


def test_a_lost_node_is_drained_and_an_away_one_is_left_alone() -> None:
    lost = node("node-0", state=NodeState.LOST)
    lost.lost_reason = "the ranks of j-1 stopped stepping"
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
    by_host = NodeInfo(id="rack3-07", hostname="gpu-07.cluster.example")
    by_host.conditions = {READONLY.key: READONLY}
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
