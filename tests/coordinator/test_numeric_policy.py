"""The rewind budget, pure: numeric faults judged by recurrence, with ``now`` passed in
(no clock is read). Faults far apart each start afresh; the same fault coming back fails
the job; one node's ranks alone, again and again, hold that node and the job goes on."""

from __future__ import annotations

from coordinator import numeric_policy
from coordinator.actions import Action, FinishJob, HoldNode, RestartJob
from coordinator.node_life import REPEAT_WINDOW_S
from proto.job import JobRecord, JobSection, JobSpec, JobState
from proto.progress import Rewound
from proto.recurrence import NumericFault, recurring, same_place_steps

T0 = 1_800_000_000.0  # wall seconds


def job(nodes: int = 3, **policy: int) -> JobRecord:
    spec = JobSpec(job=JobSection(name="j", nodes=nodes, gpus_per_node=2))
    for key, value in policy.items():
        setattr(spec.policy, key, value)
    names = [f"node-{i}" for i in range(nodes)]
    return JobRecord(
        id="j-1", name="j", spec=spec, state=JobState.RUNNING, nodes=names, world_size=2 * nodes
    )


def fault(
    record: JobRecord, step: int, now: float, *ranks: int, position: int = -1
) -> list[Action]:
    """Rank 0's report of a rewind from ``step`` (data position ``step``, unless given),
    the ranks whose own loss was not finite, taken at ``now``."""
    at = step if position < 0 else position
    msg = Rewound(
        step=step - 3,
        from_step=step,
        skip_from=at - 3,
        skip_to=at + 1,
        reason="non-finite loss nan",
        ranks=list(ranks),
    )
    return numeric_policy.judge(record, numeric_policy.seen(record, msg, now))


def test_five_faults_far_apart_are_five_rewinds_and_the_job_runs() -> None:
    """The operator's soak: five non-finite losses minutes and hundreds of steps apart, on
    four different nodes (one of them twice) and once on every rank."""
    j = job(nodes=5)
    for k, (step, ranks) in enumerate(
        [(36, (2,)), (232, (4,)), (675, (6,)), (1523, range(10)), (3284, (2, 3))]
    ):
        assert fault(j, step, T0 + 120.0 * k, *ranks) == []
    assert [f.node for f in j.numeric_faults] == ["node-1", "node-2", "node-3", "", "node-1"]


def test_the_same_step_failing_three_times_fails_the_job_with_the_evidence() -> None:
    j = job()
    assert fault(j, 3292, T0, 0, 2) == []  # ranks on two nodes: no one node
    assert fault(j, 3295, T0 + 20.0, 0, 1, 2, 3, 4, 5) == []  # everywhere
    [finish] = fault(j, 3292, T0 + 40.0)  # a gradient-norm explosion: nobody's loss
    assert isinstance(finish, FinishJob) and finish.state is JobState.FAILED
    assert finish.reason.startswith("numeric fault at step 3292 (non-finite loss nan) 3 times")
    assert "within 50 steps of each other or on the same data, rewound 2 times" in finish.reason
    assert "(policy.max_rewinds = 2), not on one node alone" in finish.reason
    assert "step 3295 (not one node, " in finish.reason


def test_the_same_node_failing_three_times_while_others_do_not_is_held_and_the_job_goes_on() -> (
    None
):
    j = job()
    assert fault(j, 100, T0, 2, 3) == []  # node-1's two ranks
    assert fault(j, 105, T0 + 10.0, 3) == []  # again, within the margin: a run of two
    assert fault(j, 2000, T0 + 30.0, 0) == []  # node-0 once, far on
    hold, restart = fault(j, 9000, T0 + 1800.0, 2)  # node-1, far from both
    assert isinstance(hold, HoldNode) and hold.node == "node-1"
    assert hold.evidence.startswith(
        "the ranks of node-1 alone computed non-finite values 3 times within 60 min "
        "(policy.max_rewinds = 2): step 100 (node-1 alone, "
    )
    assert isinstance(restart, RestartJob) and restart.exclude == ("node-1",)
    assert not restart.graceful  # from its newest checkpoint, not one the node wrote now
    assert restart.failure is not None and restart.failure.cause == "numeric"
    assert restart.reason.endswith("; node-1 held for a person, left out")
    assert [f.node for f in j.numeric_faults] == ["node-0"]  # node-1's are spent


def test_a_run_on_one_node_holds_it_rather_than_failing_the_job() -> None:
    """The same place three times, but node-1's ranks alone each time: the node, not the
    model (a shard of bad data would follow the data to another node and fail there)."""
    j = job()
    fault(j, 100, T0, 2)
    fault(j, 101, T0 + 5.0, 2)
    hold, _ = fault(j, 102, T0 + 10.0, 3)
    assert isinstance(hold, HoldNode) and hold.node == "node-1"


def test_one_nodes_faults_count_within_the_hour() -> None:
    j = job()
    fault(j, 100, T0, 2)
    fault(j, 1000, T0 + 1000.0, 2)
    assert fault(j, 2000, T0 + REPEAT_WINDOW_S + 1.0, 2) == []  # the first is forgotten
    assert len(j.numeric_faults) == 2
    [hold, _] = fault(j, 3000, T0 + REPEAT_WINDOW_S + 2.0, 2)
    assert isinstance(hold, HoldNode)


def test_the_same_data_far_on_is_the_same_fault_coming_back() -> None:
    j = job()
    fault(j, 100, T0, 0, 2, position=7)
    fault(j, 5000, T0 + 60.0, 0, 2, position=7)
    [finish] = fault(j, 9000, T0 + 120.0, 0, 2, position=7)
    assert isinstance(finish, FinishJob)


def test_no_rewinds_allowed_fails_at_the_first() -> None:
    [finish] = fault(job(max_rewinds=0), 10, T0, 2)
    assert isinstance(finish, FinishJob)
    assert finish.reason.endswith("policy.max_rewinds = 0: no rewinds")


def test_a_larger_budget_allows_more_of_the_same() -> None:
    j = job(max_rewinds=4)
    assert all(fault(j, 100 + k, T0 + k, 2) == [] for k in range(4))
    [hold, _] = fault(j, 104, T0 + 4.0, 2)
    assert isinstance(hold, HoldNode)


def test_the_suspect_is_one_node_of_several() -> None:
    j = job()
    assert numeric_policy.suspect(j, [4, 5]) == "node-2"
    assert numeric_policy.suspect(j, [1, 2]) == ""  # two nodes
    assert numeric_policy.suspect(j, []) == ""  # nobody said
    assert numeric_policy.suspect(j, [99]) == ""  # not a rank of this attempt
    assert numeric_policy.suspect(job(nodes=1), [0]) == ""  # the only node: no telling


def test_more_non_finite_ranks_than_a_report_names_are_not_one_nodes() -> None:
    j = job(nodes=3)
    msg = Rewound(step=7, from_step=10, skip_from=7, skip_to=11, ranks=[2, 3], nonfinite=70)
    assert numeric_policy.seen(j, msg, T0).node == ""


def test_the_record_keeps_at_most_its_share() -> None:
    j = job()
    for k in range(numeric_policy.KEEP + 10):
        fault(j, 1000 * (k + 1), T0 + k)
    assert len(j.numeric_faults) == numeric_policy.KEEP


def test_recurrence_is_within_a_checkpoint_interval_or_on_the_same_data() -> None:
    assert same_place_steps(5) == 10 and same_place_steps(200) == 200
    faults = [
        NumericFault(step=10, position=10),
        NumericFault(step=500, position=500),
        NumericFault(step=540, position=600),
        NumericFault(step=9000, position=600),
    ]
    assert [f.step for f in recurring(faults, 50)] == [500, 540, 9000]
    assert [f.step for f in recurring(faults[:2], 50)] == [500]
    assert recurring([], 50) == []
