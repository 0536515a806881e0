"""A node's life as the leader keeps it in KV (bucket ``nodelife``, one record per node):
what the agents' reports cannot say again after a failover. The faults it was drained
for (opened and closed, the last hour's: the evidence for a hold), an operator's drain
and cordon with who and why, a hold and its history, and where its probation stands.
Everything else about a node is re-derived from its agent's next beat.

Written by the leader only, compare-and-set like a job record, so a deposed leader's late
write loses. :mod:`coordinator.node_life` decides every change."""

from __future__ import annotations

import enum

import msgspec


class Phase(enum.StrEnum):
    """serving (placed on, unless cordoned) → drained (a cause open) → probation (its
    causes closed, its health gate passing) → serving; held (its faults repeat) until a
    person undrains it."""

    SERVING = "serving"
    DRAINED = "drained"
    PROBATION = "probation"
    HELD = "held"


class Fault(msgspec.Struct, kw_only=True):
    """One cause a node was drained for: a condition's key (``node.lost`` for its loss),
    its kind, the measured evidence, when it opened and closed (wall seconds)."""

    key: str
    kind: str
    evidence: str = ""
    opened_at: float = 0.0
    closed_at: float | None = None  # None: still open
    # a new occurrence of its kind (none of its kind open when it opened: two devices
    # turning read-only at once are one fault), which a hold counts
    counted: bool = True


class Mark(msgspec.Struct, kw_only=True):
    """An operator's drain or cordon: who (their NATS user, else their login, else
    ``operator``), since when, why."""

    by: str = "operator"
    since: float = 0.0
    reason: str = ""


class NodeLife(msgspec.Struct, kw_only=True):
    node: str
    phase: Phase = Phase.SERVING
    since: float = 0.0  # when it entered its phase
    faults: list[Fault] = msgspec.field(default_factory=list)  # open ones and the last hour's
    drain: Mark | None = None  # the operator's drain: only undrain lifts it
    cordon: Mark | None = None
    held: str = ""  # while held: the repeats that hold it, in words
    episode: list[str] = msgspec.field(default_factory=list)  # kinds drained for since serving
    probation_s: float = 0.0  # this probation's length: the longest of its episode's kinds
    # when its health gate last started passing on probation (None: not passing yet)
    probation_from: float | None = None
