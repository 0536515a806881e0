"""The pure half of the chaos soak (``bench/soak_plan.py``): the schedule a seed gives,
that every action is one ``inject`` accepts or one the soak carries out itself, and the
arithmetic of the report. No cluster."""

from __future__ import annotations

import pytest

from bench.soak_plan import (
    BENCH_ACTIONS,
    MIX,
    actions,
    back_to_training,
    cost,
    cost_by_fault,
    longest_stall,
    not_ready,
    parser,
    reaction,
    schedule,
    target,
    unsettled,
)
from proto.faults import parse_fault


def test_a_seed_gives_one_schedule_and_another_seed_another() -> None:
    assert schedule(30, 10, seed=7) == schedule(30, 10, seed=7)
    assert schedule(30, 10, seed=7) != schedule(30, 10, seed=8)


def test_faults_come_every_s_seconds_within_the_soak_and_each_round_has_the_whole_mix() -> None:
    plan = schedule(minutes=4, every=30, seed=1)
    assert [p.at for p in plan] == [30.0 * k for k in range(1, 8)]  # none at the very end
    long = schedule(minutes=60, every=10, seed=3)
    rounds = [long[i : i + len(MIX)] for i in range(0, 3 * len(MIX), len(MIX))]
    for faults in rounds:
        assert sorted(p.fault for p in faults) == sorted(MIX)
    for p in long:
        span = MIX[p.fault]
        assert 0 <= p.pick < 1
        if span is None:
            assert p.value == 0
        else:
            assert span[0] <= abs(p.value) <= span[1]
    offsets = {p.value > 0 for p in long if p.fault == "clock-offset"}
    assert offsets == {True, False}  # both signs are drawn


def test_every_action_is_an_inject_form_or_one_the_soak_carries_out() -> None:
    for p in schedule(minutes=60, every=10, seed=5):
        first, follow_ups = actions(p)
        for action in (first, *(a for _, a in follow_ups)):
            if action not in BENCH_ACTIONS:
                parse_fault(action)  # raises on a form inject would refuse
        assert all(delay > 0 for delay, _ in follow_ups)
    lost = next(p for p in schedule(60, 10, 5) if p.fault == "node-loss")
    assert actions(lost) == ("lose-node", [(25.0, "restart-agent")])


def test_a_notice_that_passes_is_never_withdrawn() -> None:
    """Withdrawn 10 s after its deadline, a spot notice is the withdrawn kind; the other is
    left for the agent to find passed (a minute after its deadline) and return the node."""
    plan = schedule(minutes=60, every=10, seed=5)
    withdrawn = next(p for p in plan if p.fault == "spot-notice")
    passes = next(p for p in plan if p.fault == "notice-passes")
    assert actions(withdrawn)[1] == [(withdrawn.value + 10.0, "clear")]
    assert actions(passes) == (f"spot-notice={passes.value:g}", [])
    assert {"nan-loss", "spot-notice", "notice-passes"} <= set(MIX)


def test_the_end_lists_the_live_nodes_not_ready_and_those_left_behind() -> None:
    nodes = [
        {"id": "node-0", "state": "ready", "why": ""},
        {"id": "node-1", "state": "draining", "held": True, "why": "held for a person: …"},
        {"id": "node-2", "state": "draining", "why": "probation after spot.notice: …"},
        {"id": "node-3", "state": "lost", "why": ""},  # not live: its agent is silent
        {"id": "node-4", "state": "degraded", "why": "nvme0n1 latency 405 µs"},
    ]
    assert [(n["node"], n["held"]) for n in not_ready(nodes)] == [
        ("node-1", True),
        ("node-2", False),
        ("node-4", False),
    ]
    assert [n["node"] for n in unsettled(nodes)] == ["node-2", "node-4"]
    assert not_ready(nodes[:1]) == [] and unsettled(nodes[:2]) == []


def test_the_target_is_one_of_the_jobs_nodes_by_position() -> None:
    assert target(["node-1", "node-3"], 0.0) == "node-1"
    assert target(["node-1", "node-3"], 0.99) == "node-3"
    assert target([], 0.5) is None


def test_the_reaction_is_each_job_kind_once_in_order_without_routine_ones() -> None:
    kinds = ["worker.exited", "job.checkpointed", "job.recovering", "job.restarted"]
    assert reaction([*kinds, "job.recovering", "job.bandwidth"]) == "recovering/restarted"
    assert reaction(["job.checkpointed", "node.lost"]) == "none"


def test_back_to_training_is_the_first_step_of_the_attempt_the_fault_caused() -> None:
    starts, steps = [0.0, 20.0], [1.0, 10.5, 11.0, 25.0, 26.0]
    # the doomed attempt's last step at 10.5 is not training again: the new one's at 25 is
    assert back_to_training(starts, steps, 10.0, 30.0, restarted=True) == 15.0
    # its attempt started after the next fault (at 15), but the restart was this fault's
    assert back_to_training(starts, steps, 10.0, 15.0, restarted=True) == 15.0
    # no restart: training went on (a straggler, a frozen bus)
    assert back_to_training(starts, steps, 10.0, 15.0, restarted=False) == 0.5
    # the restart's attempt has not started yet: not back, whatever the doomed one does
    assert back_to_training([0.0], steps, 10.0, 30.0, restarted=True) is None
    assert back_to_training(starts, [1.0], 10.0, 30.0, restarted=True) is None


def test_a_faults_cost_is_what_each_bucket_but_productive_gained_until_the_next() -> None:
    before = {"productive": 100.0, "recovery": 10.0, "paused": 5.0, "checkpoint_stall": 2.0}
    after = {"productive": 150.0, "recovery": 14.5, "paused": 5.0, "checkpoint_stall": 1.0}
    assert cost(before, {**after, "lost_work": 3.0}) == {"recovery": 4.5, "lost_work": 3.0}
    assert cost(None, after) == {} and cost(before, {}) == {}


def test_the_costs_are_summed_by_fault_kind_dearest_first() -> None:
    faults = [
        {"fault": "hang", "cost": {"recovery": 8.0}},
        {"fault": "rank-kill", "cost": {"recovery": 2.0, "lost_work": 0.5}},
        {"fault": "hang", "cost": {"recovery": 7.0, "lost_work": 1.0}},
        {"fault": "nvme-spike", "cost": {}},
    ]
    assert cost_by_fault(faults) == [
        ("hang", 16.0, {"recovery": 15.0, "lost_work": 1.0}),
        ("rank-kill", 2.5, {"recovery": 2.0, "lost_work": 0.5}),
        ("nvme-spike", 0.0, {}),
    ]


def test_the_longest_stall_skips_stretches_when_the_job_was_paused_or_waiting() -> None:
    steps = [1.0, 2.0, 3.0, 13.0, 14.0]
    assert longest_stall(steps, [], 0.0, 15.0) == (10.0, 3.0)
    # paused from 5 to 11: what is left of that gap is 3→5 and 11→13
    assert longest_stall(steps, [(5.0, 11.0)], 0.0, 15.0) == (2.0, 3.0)
    # no step at all after the last one: the stall runs to the end
    assert longest_stall([1.0], [], 0.0, 40.0) == (39.0, 1.0)
    # the stretches either side of a pause are two, not one
    assert longest_stall([1.0, 40.0], [(10.0, 30.0)], 0.0, 40.0) == (10.0, 30.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--every", "30", "--seed", "1"],
        ["--minutes", "0", "--every", "30", "--seed", "1"],
        ["--minutes", "4", "--every", "-1", "--seed", "1"],
        ["--minutes", "4", "--every", "30", "--seed", "x"],
    ],
)
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_good_arguments_parse() -> None:
    args = parser().parse_args(["--minutes", "4", "--every", "30", "--seed", "1"])
    assert (args.minutes, args.every, args.seed, args.json, args.dir) == (4, 30, 1, None, None)
