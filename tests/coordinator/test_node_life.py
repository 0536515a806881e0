"""A node's life, pure: every row of the transition table taken by a scenario, with
``now`` passed in (no clock is read), and the defaults the docs state."""

from __future__ import annotations

from typing import ClassVar

import pytest

from coordinator import node_life as nl
from coordinator import node_verbs
from coordinator import node_view as nv
from coordinator.node_life import Cause, Effect, Evidence, Input, Step
from proto.node_life import NodeLife, Phase

READONLY = Cause("nvme.readonly:n:nvme0n1", "nvme.readonly", "nvme0n1 read-only (ro=1)")
HOT = Cause("gpu.thermal:n:0", "gpu.thermal", "GPU 0 at 96 °C (critical 90 °C)")
LINK = Cause("net.link:n:data0", "net.link", "data0 down (carrier 0)")
QUIET = Evidence()
WARM = Evidence(gate="nvme0n1 latency 405 µs above 100 µs")


class Tour:
    """One node's record driven through inputs; every row taken is remembered."""

    taken: ClassVar[set[tuple[Phase, Input]]] = set()

    def __init__(self) -> None:
        self.life = NodeLife(node="n")
        self.steps: list[Step] = []

    def see(self, now: float, *causes: Cause, gate: str = "") -> list[Step]:
        self.life, steps = nl.step(self.life, Evidence(causes=causes, gate=gate), now)
        return self._took(steps)

    def ask(self, now: float, action: str, reason: str = "", by: str = "alice") -> str:
        self.life, steps, note = node_verbs.command(self.life, action, by, reason, now)
        self._took(steps)
        return note

    def hold(self, now: float, evidence: str = "ranks of n alone non-finite 3 times") -> Step:
        self.life, steps = node_verbs.hold(self.life, evidence, now)
        return self._took(steps)[0]

    def _took(self, steps: list[Step]) -> list[Step]:
        for s in steps:
            Tour.taken.add((s.before, s.input))
        self.steps += steps
        return steps

    @property
    def phase(self) -> Phase:
        return self.life.phase


def inputs(steps: list[Step]) -> list[Input]:
    return [s.input for s in steps]


def fault_drains_and_returns_after_its_probation() -> None:
    t = Tour()
    [opened] = t.see(100.0, READONLY)
    assert (opened.before, opened.input, opened.after) == (
        Phase.SERVING,
        Input.OPENED,
        Phase.DRAINED,
    )
    assert opened.effects == (Effect.SAVE, Effect.DRAINED) and opened.fault is not None
    assert opened.fault.evidence == "nvme0n1 read-only (ro=1)"
    assert t.see(101.0, READONLY) == []  # still open: said once
    assert nv.slurm_cause(t.life) == (READONLY.key, READONLY.evidence)
    closed, passed = t.see(200.0)  # writable again, and its gate passes
    assert (closed.input, closed.after) == (Input.CLOSED, Phase.PROBATION)
    assert passed.input is Input.GATE_PASSED
    assert nv.probation_until(t.life) == 200.0 + nl.PROBATION_S["nvme.readonly"]
    assert "probation after nvme.readonly: takes work at" in nv.drain_reason(t.life, 201.0)
    assert nv.slurm_cause(t.life) == ("probation", "after nvme.readonly")  # still in Slurm
    assert t.see(499.0) == []
    [served] = t.see(500.0)
    assert (served.input, served.after) == (Input.SERVED, Phase.SERVING)
    assert served.effects == (Effect.SAVE, Effect.RETURNED)
    assert served.fault is not None and served.fault.closed_at == 200.0
    assert nv.drain_reason(t.life, 500.0) == "" and nv.slurm_cause(t.life) is None


def a_failing_gate_starts_the_probation_again() -> None:
    t = Tour()
    t.see(0.0, READONLY)
    assert inputs(t.see(10.0, gate=WARM.gate)) == [Input.CLOSED]  # closed, gate failing
    assert "waiting for its health gate" in nv.drain_reason(t.life, 10.0)
    assert inputs(t.see(20.0)) == [Input.GATE_PASSED]
    assert inputs(t.see(100.0, gate=WARM.gate)) == [Input.GATE_FAILED]
    assert t.see(110.0, gate=WARM.gate) == []
    assert inputs(t.see(120.0)) == [Input.GATE_PASSED]
    assert t.see(120.0 + 299.0) == []  # 300 s from the gate passing again, not from 20 s
    assert inputs(t.see(420.0)) == [Input.SERVED]


def a_fault_on_probation_drains_again_and_the_longest_probation_counts() -> None:
    t = Tour()
    t.see(0.0, LINK)
    t.see(10.0)
    assert t.life.probation_s == nl.PROBATION_S["net.link"]
    [again] = t.see(20.0, HOT)
    assert (again.before, again.input, again.after) == (
        Phase.PROBATION,
        Input.OPENED,
        Phase.DRAINED,
    )
    assert Effect.DRAINED in again.effects
    assert inputs(t.see(30.0, HOT, LINK)) == [Input.OPENED]  # a second cause while drained
    [eased] = t.see(40.0, LINK)
    assert (eased.input, eased.after, eased.fault) == (Input.EASED, Phase.DRAINED, eased.fault)
    assert eased.fault is not None and eased.fault.key == HOT.key
    t.see(50.0)
    assert t.life.probation_s == max(nl.PROBATION_S["gpu.thermal"], nl.PROBATION_S["net.link"])


def three_of_a_kind_within_an_hour_hold_it_for_a_person() -> None:
    t = Tour()
    t.see(0.0, READONLY)  # 1st: serving → drained
    t.see(10.0)
    t.see(20.0, READONLY)  # 2nd: on probation → drained
    t.see(30.0)
    t.see(400.0)  # served
    assert t.phase is Phase.SERVING
    [held] = t.see(600.0, READONLY)  # 3rd, within the hour
    assert (held.before, held.input, held.after) == (Phase.SERVING, Input.REPEATED, Phase.HELD)
    assert held.effects == (Effect.SAVE, Effect.HELD)
    assert t.life.held.startswith("nvme.readonly 3 times within 60 min (00:00:00 UTC, 00:00:20")
    assert inputs(t.see(700.0)) == [Input.CLOSED]  # closed: held all the same
    assert t.see(5000.0) == [] and t.phase is Phase.HELD
    assert nv.slurm_cause(t.life) == ("held", t.life.held)
    assert nv.drain_reason(t.life, 0).startswith("held for a person: nvme.readonly 3 times")
    assert inputs(t.see(5001.0, HOT)) == [Input.OPENED]
    assert inputs(t.see(5002.0, HOT, LINK)) == [Input.OPENED]
    assert inputs(t.see(5003.0, LINK)) == [Input.EASED]
    note = t.ask(5004.0, "undrain")
    assert t.phase is Phase.DRAINED and note == f"it stays drained for {LINK.key}: {LINK.evidence}"
    assert [f.key for f in t.life.faults] == [LINK.key]  # its history forgiven
    t.see(5005.0)
    t.see(5005.0 + 120.0)
    assert t.phase is Phase.SERVING


def held_from_drained_and_from_probation_and_repeated_while_held() -> None:
    t = Tour()
    for now in (0.0, 20.0):
        t.see(now, LINK)
        t.see(now + 10.0)
    assert t.phase is Phase.PROBATION
    assert inputs(t.see(40.0, LINK)) == [Input.REPEATED]  # the 3rd on probation
    t.ask(41.0, "undrain")
    t.see(42.0)  # open faults kept by the undrain closed now
    t.see(42.0 + 120.0)
    t = Tour()
    t.see(0.0, LINK)
    t.see(10.0)
    t.see(20.0, LINK)
    t.see(30.0, LINK, HOT)
    t.see(40.0, HOT)
    assert t.phase is Phase.DRAINED and inputs(t.see(50.0, HOT, LINK)) == [Input.REPEATED]
    assert inputs(t.see(60.0, HOT)) == [Input.EASED]
    assert inputs(t.see(70.0, HOT, LINK)) == [Input.REPEATED]  # a 4th while held
    assert t.phase is Phase.HELD
    t.see(80.0)
    assert t.ask(90.0, "undrain") == "" and t.phase is Phase.SERVING
    assert t.steps[-1].effects == (Effect.SAVE, Effect.RETURNED) and t.steps[-1].by == "alice"


def two_devices_failing_together_are_one_fault() -> None:
    other = Cause("nvme.readonly:n:nvme1n1", "nvme.readonly", "nvme1n1 read-only (ro=1)")
    t = Tour()
    for now in (0.0, 20.0):
        t.see(now, READONLY, other)  # both devices at once
        t.see(now + 10.0)
    assert t.phase is Phase.PROBATION and not t.life.held
    t.see(40.0, other)
    t.see(41.0, READONLY, other)  # the first of a pair open already: no new occurrence
    assert t.phase is Phase.HELD
    assert t.life.held.startswith("nvme.readonly 3 times within 60 min")
    assert t.life.held.count("UTC") == 3


def faults_an_hour_apart_hold_nothing() -> None:
    t = Tour()
    for now in (0.0, 2000.0, 4000.0):
        t.see(now, READONLY)
        t.see(now + 10.0)
        t.see(now + 400.0)
    assert t.phase is Phase.SERVING and not t.life.held
    assert len(t.life.faults) == 2  # the first is past the hour: forgotten


def the_operators_drain_is_lifted_only_by_undrain() -> None:
    t = Tour()
    t.ask(0.0, "drain", "disk swap")
    [drain] = [s for s in t.steps if s.input is Input.DRAIN]
    assert (drain.before, drain.after, drain.by) == (Phase.SERVING, Phase.DRAINED, "alice")
    assert drain.effects == (Effect.SAVE, Effect.DRAINED, Effect.EVACUATE)
    assert nv.drain_reason(t.life, 1.0) == "drained by alice: disk swap"
    assert nv.slurm_cause(t.life) == (nl.OPERATOR, "disk swap")
    assert inputs(t.see(10.0, READONLY)) == [Input.OPENED]
    assert inputs(t.see(20.0)) == [Input.EASED]  # the device came back; the drain stays
    assert t.see(10_000.0) == [] and t.phase is Phase.DRAINED
    t.ask(10_001.0, "drain", "disk swap, again")  # drained again: said again
    t.see(10_002.0, READONLY)
    assert t.ask(10_003.0, "undrain") == f"it stays drained for {READONLY.key}: {READONLY.evidence}"
    assert t.life.drain is None and t.phase is Phase.DRAINED
    t.see(10_004.0)
    assert t.phase is Phase.PROBATION
    t.ask(10_005.0, "drain", "firmware")  # on probation
    assert t.phase is Phase.DRAINED
    assert t.ask(10_006.0, "undrain") == "" and t.phase is Phase.SERVING  # no probation: vouched
    t.see(10_007.0, READONLY)
    t.see(10_008.0)
    assert t.phase is Phase.PROBATION
    assert t.ask(10_009.0, "undrain") == "" and t.phase is Phase.SERVING
    assert t.ask(10_010.0, "undrain") == "it was neither drained nor cordoned"
    held = Tour()
    held.life.phase = Phase.HELD
    held.ask(0.0, "drain", "RMA")
    assert held.phase is Phase.HELD and held.life.drain is not None


def a_cordon_in_every_phase_changes_nothing_but_placement() -> None:
    for phase in Phase:
        t = Tour()
        t.life.phase = phase
        assert t.ask(0.0, "cordon", "kernel update") == "" and t.phase is phase
        assert t.life.cordon is not None and t.life.cordon.by == "alice"
        assert t.ask(1.0, "cordon") == "already cordoned by alice"
        assert t.steps[-1].effects == (Effect.SAVE, Effect.CORDONED)
        t.ask(2.0, "undrain")
        assert t.life.cordon is None and t.steps[0].input is Input.CORDON
        assert Input.UNCORDON in inputs(t.steps)


def the_coordinators_hold_on_its_numbers_needs_a_person_from_any_phase() -> None:
    """Its ranks alone computed non-finite values again and again: held at once, whatever
    its phase (a health gate cannot see arithmetic, so no probation would clear it)."""
    t = Tour()
    held = t.hold(10.0)
    assert (held.before, held.after, held.effects) == (
        Phase.SERVING,
        Phase.HELD,
        (Effect.SAVE, Effect.HELD),
    )
    assert held.fault is not None and held.fault.key == nl.NUMERIC
    assert held.fault.closed_at == 10.0  # nothing the node reports can close it
    assert t.life.held == "ranks of n alone non-finite 3 times"
    assert nv.drain_reason(t.life, 11.0).startswith("held for a person: ranks of n alone")
    assert nv.slurm_cause(t.life) == ("held", t.life.held)
    assert t.see(5000.0) == []  # an hour on, nothing open: still held
    assert t.hold(5001.0, "again").effects == (Effect.SAVE,)  # said once
    assert t.ask(5002.0, "undrain") == "" and t.phase is Phase.SERVING
    t.see(5003.0, READONLY)
    assert t.hold(5004.0).before is Phase.DRAINED and t.phase is Phase.HELD
    t.ask(5005.0, "undrain")
    t.see(5006.0, READONLY)
    t.see(5007.0)
    assert t.phase is Phase.PROBATION and t.hold(5008.0).after is Phase.HELD


SCENARIOS = [
    fault_drains_and_returns_after_its_probation,
    a_failing_gate_starts_the_probation_again,
    a_fault_on_probation_drains_again_and_the_longest_probation_counts,
    three_of_a_kind_within_an_hour_hold_it_for_a_person,
    held_from_drained_and_from_probation_and_repeated_while_held,
    two_devices_failing_together_are_one_fault,
    faults_an_hour_apart_hold_nothing,
    the_operators_drain_is_lifted_only_by_undrain,
    a_cordon_in_every_phase_changes_nothing_but_placement,
    the_coordinators_hold_on_its_numbers_needs_a_person_from_any_phase,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_scenario(scenario: object) -> None:
    assert callable(scenario)
    scenario()


def test_the_scenarios_take_every_row_of_the_table() -> None:
    Tour.taken = set()
    for scenario in SCENARIOS:
        scenario()
    assert set(nl.TABLE) - Tour.taken == set()


def test_a_silent_node_changes_nothing() -> None:
    life = NodeLife(node="n", phase=Phase.PROBATION, probation_from=0.0, probation_s=60.0)
    assert nl.step(life, Evidence(known=False), 1e9) == (life, [])


def test_a_new_leader_re_deriving_a_node_changes_nothing_that_is_right() -> None:
    """The record as the last leader saved it, the agents' reports as they stand: the
    same evidence takes no step; a cause closed meanwhile only closes it (no second
    node.drained)."""
    first = Tour()
    first.see(0.0, READONLY)
    saved = first.life
    again, steps = nl.step(saved, Evidence(causes=(READONLY,)), 50.0)
    assert steps == [] and again == saved
    later, steps = nl.step(saved, QUIET, 60.0)
    assert inputs(steps) == [Input.CLOSED, Input.GATE_PASSED] and later.phase is Phase.PROBATION
    assert all(Effect.DRAINED not in s.effects for s in steps)
    assert saved.phase is Phase.DRAINED  # the step made a new record


def test_the_defaults_are_the_documented_ones() -> None:
    assert dict(nl.PROBATION_S) == {
        "nvme.readonly": 300.0,
        "gpu.thermal": 300.0,
        "topology.degraded": 300.0,
        "net.link": 120.0,
        "clock.drift": 120.0,
        "spot.notice": 60.0,
        "node.lost": 60.0,
    }
    assert nl.DEFAULT_PROBATION_S == 300.0
    assert (nl.REPEATS, nl.REPEAT_WINDOW_S) == (3, 3600.0)


def test_a_spot_notice_that_passes_returns_after_its_probation_and_stays_on_record() -> None:
    """The notice's condition closed (withdrawn, or its deadline went by with the node up):
    the node takes work again once its gate has passed for the notice's probation, and
    the notice stays in its history for the hour; notices never hold a node."""
    notice = Cause("spot.notice:n:aws", "spot.notice", "aws: terminate by 10:00:00 UTC")
    t = Tour()
    t.see(0.0, notice)
    assert inputs(t.see(85.0)) == [Input.CLOSED, Input.GATE_PASSED]
    assert t.see(144.0) == []
    [served] = t.see(145.0)
    assert served.input is Input.SERVED and served.probation_s == 60.0
    assert served.fault is not None and served.fault.key == notice.key
    assert [(f.key, f.evidence, f.closed_at) for f in t.life.faults] == [
        (notice.key, notice.evidence, 85.0)
    ]
    for opened in (200.0, 400.0):  # a second and a third notice within the hour
        [drained] = t.see(opened, notice)
        assert drained.input is Input.OPENED and not t.life.held
        t.see(opened + 10.0)
    assert len(t.life.faults) == 3 and not t.life.held


def test_probation_overrides() -> None:
    assert nl.parse_probation(["nvme.readonly=5", "node.lost=0"])["nvme.readonly"] == 5.0
    assert nl.parse_probation([])["gpu.thermal"] == 300.0
    for bad in ("nvme.readonly", "=5", "x=-1", "x=nan", "x=soon"):
        with pytest.raises(ValueError, match="want KIND=SECONDS"):
            nl.parse_probation([bad])
    t = Tour()
    t.life, _ = nl.step(t.life, Evidence(causes=(READONLY,)), 0.0, {"nvme.readonly": 5.0})
    t.life, steps = nl.step(t.life, QUIET, 1.0, {"nvme.readonly": 5.0})
    t.life, steps = nl.step(t.life, QUIET, 6.0, {"nvme.readonly": 5.0})
    assert inputs(steps) == [Input.SERVED]
