"""A node's life: whether it may take work, decided from its evidence as a job's state is
(:mod:`coordinator.job_machine`). Pure: a node's record (:class:`NodeLife`), what its
agent reports now (:class:`Evidence`) or what an operator asks, and ``now`` (wall
seconds) in; the new record and the steps taken out, each a row of :data:`TABLE` with its
effects. :mod:`coordinator.node_keeper` feeds it and carries the effects out.

A node is drained while a cause is open: a critical condition its agent reports, a
judgement the coordinator made on a condition (a clock a resync could not bring back),
its loss (``node.lost``), or an operator's drain, which only ``undrain`` lifts. When the
last cause closes the node is on probation: back in service once its own health gate (no
open warning or critical condition: what ``nodeagent --health-gate`` answers Slurm) has
passed for the probation of the kinds it was drained for (:data:`PROBATION_S`); a gate
that fails meanwhile starts it again. The same kind of fault :data:`REPEATS` times within
:data:`REPEAT_WINDOW_S` holds the node for a person: drained, whatever its conditions,
until ``undrain``. So does the coordinator's verdict on the numbers a node computes (its
ranks alone non-finite, again and again: :mod:`coordinator.numeric_policy`), at once: its
health gate cannot see arithmetic, so no probation could clear it. A cordon only stops new
placements. The inputs that are not the node's evidence (an operator's verbs, that
verdict) are :mod:`coordinator.node_verbs`'.

Each threshold has this one owner; ``coordinator --probation KIND=S`` overrides a kind's
probation (:func:`parse_probation`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

import msgspec

from proto.node_life import Fault, NodeLife, Phase

LOST = "node.lost"  # the cause key (and kind) of a node declared lost
NUMERIC = "numeric"  # the cause key (and kind) of a node held for computing wrong numbers
OPERATOR = "operator"  # the Slurm reason's key of an operator's drain
# s: how long a node's health gate must pass, after the last cause it was drained for
# closed, before it takes work again; by the kind of cause (the longest of its drain's)
PROBATION_S: Mapping[str, float] = {
    "nvme.readonly": 300.0,  # a device that turned read-only once may again: 5 minutes
    "gpu.thermal": 300.0,  # cooled, and staying cool under the next job's load
    "topology.degraded": 300.0,  # a link retrained: watch it hold
    "net.link": 120.0,  # flaps within it open net.flap and the gate fails
    "clock.drift": 120.0,
    # a notice withdrawn or gone by with the machine still up: nothing was wrong with it,
    # but a provider that reclaims it late does so before it takes work again
    "spot.notice": 60.0,
    LOST: 60.0,  # back from a reboot or a long outage: its first checks in
}
DEFAULT_PROBATION_S = 300.0  # any other critical condition
REPEATS = 3  # the same kind of fault this many times …
REPEAT_WINDOW_S = 3600.0  # … within this long holds the node for a person
# kinds that drain and serve their probation but never hold a node: a preemption notice is
# the provider's word about the machine, not a fault of it, and no person can mend it
NEVER_HELD = frozenset({"spot.notice"})


class Input(StrEnum):
    OPENED = "opened"  # a cause opened
    REPEATED = "repeated"  # a cause opened, its kind's REPEATS-th within the window
    EASED = "eased"  # a cause closed, another stays open
    CLOSED = "closed"  # the last cause closed
    GATE_FAILED = "gate_failed"  # on probation, its health gate refuses work
    GATE_PASSED = "gate_passed"  # on probation, its health gate passes (again)
    SERVED = "served"  # its probation passed
    DRAIN = "drain"  # the operator's
    UNDRAIN = "undrain"  # the operator's, nothing else open
    UNDRAIN_OPEN = "undrain_open"  # the operator's, a cause still open: that stays
    HOLD = "hold"  # the coordinator's verdict on what the node computed: held at once
    CORDON = "cordon"
    UNCORDON = "uncordon"


class Effect(StrEnum):
    SAVE = "save"  # the record changed: written (fenced) before anything is said or done
    DRAINED = "drained"  # node.drained
    HELD = "held"  # node.drained, held: critical, a person must look
    RETURNED = "returned"  # node.returned
    CORDONED = "cordoned"  # node.cordoned, on or off
    EVACUATE = "evacuate"  # its jobs go elsewhere, checkpoint first where the loop can


@dataclass(frozen=True)
class Row:
    after: Phase
    effects: tuple[Effect, ...]


S, D, P, H = Phase.SERVING, Phase.DRAINED, Phase.PROBATION, Phase.HELD
E = Effect
TABLE: dict[tuple[Phase, Input], Row] = {
    (S, Input.OPENED): Row(D, (E.SAVE, E.DRAINED)),
    (S, Input.REPEATED): Row(H, (E.SAVE, E.HELD)),
    (S, Input.DRAIN): Row(D, (E.SAVE, E.DRAINED, E.EVACUATE)),
    (D, Input.OPENED): Row(D, (E.SAVE,)),
    (D, Input.REPEATED): Row(H, (E.SAVE, E.HELD)),
    (D, Input.EASED): Row(D, (E.SAVE,)),
    (D, Input.CLOSED): Row(P, (E.SAVE,)),
    (D, Input.DRAIN): Row(D, (E.SAVE, E.DRAINED, E.EVACUATE)),
    (D, Input.UNDRAIN): Row(S, (E.SAVE, E.RETURNED)),
    (D, Input.UNDRAIN_OPEN): Row(D, (E.SAVE,)),
    (P, Input.OPENED): Row(D, (E.SAVE, E.DRAINED)),
    (P, Input.REPEATED): Row(H, (E.SAVE, E.HELD)),
    (P, Input.GATE_FAILED): Row(P, (E.SAVE,)),
    (P, Input.GATE_PASSED): Row(P, (E.SAVE,)),
    (P, Input.SERVED): Row(S, (E.SAVE, E.RETURNED)),
    (P, Input.DRAIN): Row(D, (E.SAVE, E.DRAINED, E.EVACUATE)),
    (P, Input.UNDRAIN): Row(S, (E.SAVE, E.RETURNED)),
    (H, Input.OPENED): Row(H, (E.SAVE,)),
    (H, Input.REPEATED): Row(H, (E.SAVE,)),
    (H, Input.EASED): Row(H, (E.SAVE,)),
    (H, Input.CLOSED): Row(H, (E.SAVE,)),
    (H, Input.DRAIN): Row(H, (E.SAVE, E.DRAINED, E.EVACUATE)),
    (H, Input.UNDRAIN): Row(S, (E.SAVE, E.RETURNED)),
    (H, Input.UNDRAIN_OPEN): Row(D, (E.SAVE,)),
    **{(phase, Input.HOLD): Row(H, (E.SAVE, E.HELD)) for phase in (S, D, P)},
    (H, Input.HOLD): Row(H, (E.SAVE,)),
    **{(phase, Input.CORDON): Row(phase, (E.SAVE, E.CORDONED)) for phase in Phase},
    **{(phase, Input.UNCORDON): Row(phase, (E.SAVE, E.CORDONED)) for phase in Phase},
}


@dataclass(frozen=True)
class Cause:
    """Why a node must not take work now: a key, its kind, the evidence in words."""

    key: str
    kind: str
    evidence: str


@dataclass(frozen=True)
class Evidence:
    """What the coordinator knows of a node now. ``known`` false: its agent is silent
    (away), so nothing is known and nothing changes. ``gate``: why its health gate would
    refuse work ("" when it passes)."""

    known: bool = True
    causes: tuple[Cause, ...] = ()
    gate: str = ""


@dataclass(frozen=True)
class Step:
    """One row taken: the input, the phases around it, its effects, the fault it
    concerns (the one opened, the last closed) and who asked (an operator's input)."""

    input: Input
    before: Phase
    after: Phase
    effects: tuple[Effect, ...]
    fault: Fault | None = None
    by: str = ""
    probation_s: float = 0.0  # served: the probation its gate passed


def fire(
    life: NodeLife, input_: Input, now: float, fault: Fault | None = None, by: str = ""
) -> Step:
    """Take the row for ``input_`` in the node's phase (a missing row is a bug)."""
    row = TABLE[(life.phase, input_)]
    before = life.phase
    if row.after is not before:
        life.phase, life.since = row.after, now
    waited = life.probation_s if input_ is Input.SERVED else 0.0
    return Step(input_, before, row.after, row.effects, fault, by, waited)


def step(
    life: NodeLife, ev: Evidence, now: float, probation: Mapping[str, float] = PROBATION_S
) -> tuple[NodeLife, list[Step]]:
    """The node's record after what its agent reports now; a new record, the old one
    untouched."""
    if not ev.known:
        return life, []
    life = copy_of(life)
    steps: list[Step] = []
    _forget_old(life, now)
    current = {c.key: c for c in ev.causes}
    for fault in open_faults(life):
        if fault.key not in current:
            fault.closed_at = now
            still = open_faults(life) or life.drain is not None
            steps.append(fire(life, Input.EASED if still else Input.CLOSED, now, fault=fault))
    known = {f.key for f in open_faults(life)}
    for cause in ev.causes:
        if cause.key in known:
            continue
        again = any(f.kind == cause.kind for f in open_faults(life))  # the same fault, wider
        fault = Fault(
            key=cause.key,
            kind=cause.kind,
            evidence=cause.evidence,
            opened_at=now,
            counted=not again and cause.kind not in NEVER_HELD,
        )
        life.faults.append(fault)
        if cause.kind not in life.episode:
            life.episode.append(cause.kind)
        repeats = _repeats(life, cause.kind, now)
        if fault.counted and len(repeats) >= REPEATS:
            life.held = history(repeats)
            steps.append(fire(life, Input.REPEATED, now, fault=fault))
        else:
            steps.append(fire(life, Input.OPENED, now, fault=fault))
    if life.phase is Phase.DRAINED and not open_faults(life) and life.drain is None:
        steps.append(fire(life, Input.CLOSED, now))  # a record that outlived its causes
    if life.phase is Phase.PROBATION:
        steps += _probation(life, ev, now, probation)
    return life, steps


def _probation(
    life: NodeLife, ev: Evidence, now: float, probation: Mapping[str, float]
) -> list[Step]:
    life.probation_s = max(
        (probation.get(k, DEFAULT_PROBATION_S) for k in life.episode), default=0.0
    )
    if ev.gate:
        if life.probation_from is None:
            return []
        life.probation_from = None
        return [fire(life, Input.GATE_FAILED, now)]
    if life.probation_from is None:
        life.probation_from = now
        passed = [fire(life, Input.GATE_PASSED, now)]
        if life.probation_s > 0:
            return passed
    else:
        passed = []
        if now - life.probation_from < life.probation_s:
            return []
    last = max(life.faults, key=lambda f: f.closed_at or 0.0, default=None)
    served = fire(life, Input.SERVED, now, fault=last)
    serve(life)
    return [*passed, served]


def history(faults: Sequence[Fault]) -> str:
    """The repeats that hold a node, in words: kind, count, window, times, evidence."""
    times = ", ".join(at(f.opened_at) for f in faults)
    window = f"{REPEAT_WINDOW_S / 60:g} min"
    return f"{faults[-1].kind} {len(faults)} times within {window} ({times}): {faults[-1].evidence}"


def parse_probation(items: Sequence[str]) -> dict[str, float]:
    """``KIND=SECONDS`` items over :data:`PROBATION_S`; ValueError names a bad one."""
    out = dict(PROBATION_S)
    for item in items:
        kind, sep, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not sep or not kind or not 0 <= seconds < float("inf"):
            raise ValueError(f"--probation {item!r}: want KIND=SECONDS, e.g. nvme.readonly=60")
        out[kind] = seconds
    return out


def serve(life: NodeLife) -> None:
    life.episode, life.probation_s, life.probation_from = [], 0.0, None


def open_faults(life: NodeLife) -> list[Fault]:
    return [f for f in life.faults if f.closed_at is None]


def _repeats(life: NodeLife, kind: str, now: float) -> list[Fault]:
    """The occurrences of ``kind`` within the window (a fault opened while another of its
    kind was open is the same occurrence)."""
    return [
        f
        for f in life.faults
        if f.kind == kind and f.counted and now - f.opened_at <= REPEAT_WINDOW_S
    ]


def _forget_old(life: NodeLife, now: float) -> None:
    life.faults = [
        f for f in life.faults if f.closed_at is None or now - f.opened_at <= REPEAT_WINDOW_S
    ]


def copy_of(life: NodeLife) -> NodeLife:
    return msgspec.convert(msgspec.to_builtins(life), NodeLife)


def at(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%H:%M:%S UTC")
