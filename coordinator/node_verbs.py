"""What is decided about a node besides its evidence (:mod:`coordinator.node_life`): an
operator's ``cordon``, ``drain`` and ``undrain``, and the coordinator's hold on the numbers
a node computes. Pure, as the evidence's decision is: a node's record and ``now`` in, the
new record and the steps taken out."""

from __future__ import annotations

from coordinator.node_life import NUMERIC, Input, Step, copy_of, fire, open_faults, serve
from proto.node_life import Fault, Mark, NodeLife, Phase


def command(
    life: NodeLife, action: str, by: str, reason: str, now: float
) -> tuple[NodeLife, list[Step], str]:
    """An operator's ``cordon``, ``drain`` or ``undrain`` of the node; the new record,
    the steps, and a note on what it did not change ("" when it did all it says)."""
    life = copy_of(life)
    by = by or "operator"
    match action:
        case "cordon":
            if life.cordon is not None:
                return life, [], f"already cordoned by {life.cordon.by}"
            life.cordon = Mark(by=by, since=now, reason=reason)
            return life, [fire(life, Input.CORDON, now, by=by)], ""
        case "drain":
            life.drain = Mark(by=by, since=now, reason=reason)
            return life, [fire(life, Input.DRAIN, now, by=by)], ""
    steps = []
    if life.cordon is not None:
        life.cordon = None
        steps.append(fire(life, Input.UNCORDON, now, by=by))
    if life.phase is Phase.SERVING:
        return life, steps, "" if steps else "it was neither drained nor cordoned"
    life.drain, life.held = None, ""
    life.faults = open_faults(life)  # a person vouches for it: its history starts again
    life.episode = [f.kind for f in life.faults]
    if opened := open_faults(life):
        steps.append(fire(life, Input.UNDRAIN_OPEN, now, fault=opened[0], by=by))
        return life, steps, f"it stays drained for {opened[0].key}: {opened[0].evidence}"
    steps.append(fire(life, Input.UNDRAIN, now, by=by))
    serve(life)
    return life, steps, ""


def hold(life: NodeLife, evidence: str, now: float) -> tuple[NodeLife, list[Step]]:
    """The node's ranks alone computed non-finite values, again and again (``evidence``:
    the faults, their steps and times): held for a person at once. Silent data corruption
    passes every health gate (none of them checks arithmetic), so a probation would hand
    the next job the same wrong numbers; a person runs the vendor's diagnostics and
    ``undrain`` returns it. The fault is on record (closed: nothing the node reports can
    close it) as the evidence of its hold."""
    life = copy_of(life)
    fault = Fault(key=NUMERIC, kind=NUMERIC, evidence=evidence, opened_at=now, closed_at=now)
    life.faults.append(fault)
    life.held = evidence
    return life, [fire(life, Input.HOLD, now, fault=fault)]
