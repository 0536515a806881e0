"""The policy's answer to network link conditions: a data link down on a job's node takes
the node out of the job with the evidence; flaps, errors and RDMA ports are warnings."""

from __future__ import annotations

import pytest

from coordinator import actions, policy
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import NetLink, WorkerExited, WorkerHung
from proto.job import JobRecord, JobSection, JobSpec, JobState


def job(state: JobState = JobState.RUNNING) -> JobRecord:
    return JobRecord(
        id="t-1",
        name="t",
        spec=JobSpec(job=JobSection(name="t", nodes=2)),
        state=state,
        nodes=["node-0", "node-1"],
        world_size=2,
        target_steps=100,
        attempt=1,
    )


def link_down(node: str = "node-1", active: bool = True) -> Condition:
    return Condition(
        kind=ConditionKind.NET_LINK,
        node=node,
        subject="data0",
        active=active,
        severity=Severity.CRITICAL,
        reason="data0 carrier 0, operstate down",
        value=0.0,
    )


def test_data_link_down_on_a_job_node_drains_it_and_restarts_without_it() -> None:
    event = NetLink(node="node-1", interface="data0", condition=link_down())
    [restart] = policy.decide(job(), event)  # drained by its critical condition itself
    why = "data link down on node-1: data0 carrier 0, operstate down"
    assert isinstance(restart, actions.RestartJob)
    assert (restart.reason, restart.exclude) == (why, ("node-1",))
    assert restart.failure is not None and restart.failure.node == "node-1"
    # the collectives cannot reach a step boundary over a dead link: no graceful wait
    assert not restart.graceful


def test_it_fires_once_per_fault() -> None:
    """Once the restart is under way the job no longer hosts the node's ranks; an attempt
    without the node does not hear about it; its closing changes nothing."""
    assert policy.on_condition(job(JobState.RECOVERING), link_down()) == []
    without = job()
    without.nodes = ["node-0", "node-2"]
    assert policy.on_condition(without, link_down()) == []
    assert policy.on_condition(job(), link_down(active=False)) == []


def test_a_link_down_elsewhere_does_nothing() -> None:
    assert policy.on_condition(job(), link_down(node="node-5")) == []


@pytest.mark.parametrize(
    "kind",
    [
        ConditionKind.NET_FLAP,
        ConditionKind.NET_ERRORS,
        ConditionKind.NET_RETRANS,
        ConditionKind.RDMA_PORT,
    ],
)
def test_flaps_errors_loss_and_rdma_ports_are_warnings_not_drains(kind: ConditionKind) -> None:
    cond = Condition(kind=kind, node="node-1", subject="data0", reason="data0 +4 in 60 s")
    assert policy.on_condition(job(), cond) == []


def flapping(node: str) -> Condition:
    return Condition(
        kind=ConditionKind.NET_FLAP,
        node=node,
        subject="data0",
        severity=Severity.WARNING,
        reason="data0 carrier changed 6 times in 60 s",
        value=6.0,
    )


def waiting(node: str = "node-0", **kw: object) -> WorkerHung:
    """A hang its node cannot pin on a rank of its own: the rank waits in a collective."""
    return WorkerHung(
        node=node,
        job="t-1",
        rank=0,
        attempt=1,
        step=41,
        severity=Severity.CRITICAL,
        evidence="culprit unknown: every stalled rank on this node waits in a collective",
        culprit_unknown=True,
        **kw,  # type: ignore[arg-type]
    )


def test_a_hang_in_a_collective_is_pinned_on_the_node_whose_link_is_faulty() -> None:
    [restart] = policy.decide(job(), waiting("node-0"), links={"node-1": [flapping("node-1")]})
    assert isinstance(restart, actions.RestartJob)
    assert restart.exclude == ("node-1",)  # not node-0, whose rank merely reported it
    assert "node-1: data0 carrier changed 6 times in 60 s" in restart.reason
    assert restart.failure is not None
    assert (restart.failure.node, restart.failure.cause) == ("node-1", "network")


def test_a_hang_in_a_collective_is_pinned_on_the_node_whose_tcp_retransmits() -> None:
    lossy = Condition(
        kind=ConditionKind.NET_RETRANS,
        node="node-1",
        severity=Severity.WARNING,
        reason="TCP retransmitted 4.8% of 21034 segments sent in 10 s (limit 1.0%)",
        value=0.048,
        threshold=0.01,
    )
    [restart] = policy.decide(job(), waiting("node-0"), links={"node-1": [lossy]})
    assert isinstance(restart, actions.RestartJob) and restart.exclude == ("node-1",)
    assert "node-1: TCP retransmitted 4.8%" in restart.reason


def test_without_link_evidence_no_node_is_blamed_for_a_collective_wait() -> None:
    [restart] = policy.decide(job(), waiting("node-0"))
    assert isinstance(restart, actions.RestartJob) and restart.exclude == ()
    # a faulty link on a node outside the job is no evidence about this one
    [restart] = policy.decide(job(), waiting("node-0"), links={"node-7": [flapping("node-7")]})
    assert restart.exclude == ()


def test_a_rank_with_its_own_evidence_stays_the_culprit_whatever_the_links_say() -> None:
    stopped = WorkerHung(
        node="node-0",
        job="t-1",
        rank=0,
        attempt=1,
        step=41,
        severity=Severity.CRITICAL,
        evidence="process stopped (state T) for 4.1 s",
    )
    [restart] = policy.decide(job(), stopped, links={"node-1": [flapping("node-1")]})
    assert isinstance(restart, actions.RestartJob)
    assert restart.exclude == () and "rank 0 on node-0 hung" in restart.reason
    assert restart.failure is not None and restart.failure.node == "node-0"


def cannot_reach(reporter: str, peer: str) -> Condition:
    return Condition(
        kind=ConditionKind.NET_PEER,
        node=reporter,
        subject=peer,
        severity=Severity.INFO,
        reason=f"cannot reach {peer} at 198.18.1.9:40000: No route to host (2 probes in a row)",
    )


def three() -> JobRecord:
    j = job()
    j.nodes, j.world_size = ["node-0", "node-1", "node-2"], 3
    return j


def test_a_node_its_peers_cannot_reach_is_the_culprit_of_a_collective_wait() -> None:
    """node-2 cut off from both others (both ways): each of its peers says so."""
    links = {
        "node-0": [cannot_reach("node-0", "node-2")],
        "node-1": [cannot_reach("node-1", "node-2")],
        "node-2": [cannot_reach("node-2", "node-0"), cannot_reach("node-2", "node-1")],
    }
    [restart] = policy.decide(three(), waiting("node-0"), links=links)
    assert isinstance(restart, actions.RestartJob) and restart.exclude == ("node-2",)
    assert "node-2: unreachable from node-0 (cannot reach node-2" in restart.reason
    assert "node-1 (cannot reach node-2" in restart.reason
    assert restart.failure is not None and restart.failure.cause == "network"


def test_an_even_split_leaves_out_the_side_away_from_rank_0() -> None:
    """Two nodes that cannot reach each other: nothing tells the culprit from its peer,
    so the node rank 0's node cannot reach goes, and the job goes on with a spare."""
    links = {
        "node-0": [cannot_reach("node-0", "node-1")],
        "node-1": [cannot_reach("node-1", "node-0")],
    }
    [restart] = policy.decide(job(), waiting("node-1"), links=links)
    assert isinstance(restart, actions.RestartJob) and restart.exclude == ("node-1",)
    assert "node-1: cannot reach rank 0's node node-0 nor it them" in restart.reason
    # four nodes split two and two: the far half goes
    four = job()
    four.nodes, four.world_size = ["node-0", "node-1", "node-2", "node-3"], 4
    far, near = ("node-2", "node-3"), ("node-0", "node-1")
    links = {a: [cannot_reach(a, b) for b in (far if a in near else near)] for a in four.nodes}
    [restart] = policy.decide(four, waiting("node-0"), links=links)
    assert restart.exclude == far


def test_one_peers_word_alone_is_no_evidence() -> None:
    # one peer's word alone, of three nodes, is no majority
    [restart] = policy.decide(
        three(), waiting("node-0"), links={"node-0": [cannot_reach("node-0", "node-2")]}
    )
    assert restart.exclude == ()


def test_a_rank_failing_beside_a_cut_off_node_restarts_without_that_node() -> None:
    """gloo gives up on a peer it cannot reach: the ranks exit instead of waiting."""
    failed = WorkerExited(
        node="node-0",
        job="t-1",
        rank=0,
        attempt=1,
        exit_code=1,
        severity=Severity.CRITICAL,
        message="rank 0 exited with code 1",
    )
    links = {
        "node-0": [cannot_reach("node-0", "node-2")],
        "node-1": [cannot_reach("node-1", "node-2")],
    }
    [restart] = policy.decide(three(), failed, links=links)
    assert isinstance(restart, actions.RestartJob) and restart.exclude == ("node-2",)
    assert "node-2: unreachable from node-0" in restart.reason
    [restart] = policy.decide(three(), failed)  # no such evidence: nobody left out
    assert isinstance(restart, actions.RestartJob) and restart.exclude == ()
