"""How a node's life reads (:mod:`coordinator.node_life`): why it takes no work, in
``status``'s words, and what Slurm's drain says while Ringmaster's own holds. Pure."""

from __future__ import annotations

from coordinator.node_life import OPERATOR, at, open_faults
from proto.node_life import NodeLife, Phase


def probation_until(life: NodeLife) -> float | None:
    """When a node on probation takes work again if its gate keeps passing (None: not on
    probation, or its gate does not pass yet)."""
    if life.phase is not Phase.PROBATION or life.probation_from is None:
        return None
    return life.probation_from + life.probation_s


def drain_reason(life: NodeLife, now: float) -> str:
    """Why the node takes no work, in words ("" when serving)."""
    opened = open_faults(life)
    cause = f"{opened[0].key}: {opened[0].evidence}" if opened else ""
    match life.phase:
        case Phase.SERVING:
            return ""
        case Phase.HELD:
            return f"held for a person: {life.held}; undrain to return it"
        case Phase.PROBATION:
            until = probation_until(life)
            closed = ", ".join(life.episode) or "its faults"
            if until is None:
                return f"probation after {closed}: waiting for its health gate to pass"
            return f"probation after {closed}: takes work at {at(until)} if its gate passes"
    if life.drain is not None:
        said = f"drained by {life.drain.by}: {life.drain.reason}"
        return f"{said}; {cause}" if cause else said
    return cause


def slurm_cause(life: NodeLife) -> tuple[str, str] | None:
    """What Slurm's drain says (key, evidence) while Ringmaster's own holds: the
    operator's, else the first open cause, else the hold or the probation."""
    if life.phase is Phase.SERVING:
        return None
    if life.drain is not None:
        return OPERATOR, life.drain.reason
    if opened := open_faults(life):
        return opened[0].key, opened[0].evidence
    if life.phase is Phase.HELD:
        return "held", life.held
    return "probation", f"after {', '.join(life.episode) or 'a fault'}"
