"""Conditions: the one vocabulary for "something is wrong here, since then, because".

A condition is what an agent's detector latches open and closed (an NVMe device in a
latency spike, a GPU running hot, a clock out of bounds) or what an operator opens on a
job (a pause). It travels three ways, always as this struct: inside the event that
announces each change (``EventBase.condition``), in every heartbeat as the node's
authoritative set of active conditions, and in the coordinator's node records. The
coordinator's policy reacts to a condition opening or closing and files pause reasons
under :func:`condition_key`; nothing else spells a key. (node-problem-detector's
``NodeCondition`` is the model.) A node condition at ``info`` severity is advisory: shown,
but the node stays ready and eligible (``coordinator.registry``).
"""

from __future__ import annotations

import enum
import time

import msgspec


class Severity(enum.StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class ConditionKind(enum.StrEnum):
    """What is wrong. Each kind is opened and closed by one detector (or the operator)."""

    NVME_LATENCY = "nvme.latency"  # subject: block device; value: latency µs
    NVME_READONLY = "nvme.readonly"  # subject: block device
    GPU_THERMAL = "gpu.thermal"  # subject: GPU index; value: °C; severity: warning|critical
    PCIE = "pcie.degraded"  # subject: GPU index
    TOPOLOGY = "topology.degraded"  # subject: "A-B" GPU pair
    # node-wide; value: offset ms (absent: unsynchronised); severity: warning while the
    # offset is measured out of bounds, info (advisory) while only unsynchronised
    CLOCK = "clock.drift"
    # node-wide; reason: each failed check with value and want; severity: warning while a
    # required check fails, info (advisory) while only warnings stand
    PREFLIGHT = "node.preflight"
    PREEMPTION = "spot.notice"  # subject: provider
    NET_LINK = "net.link"  # subject: the data interface; critical: its link is down
    NET_FLAP = "net.flap"  # subject: interface; value: carrier changes in the window
    NET_ERRORS = "net.errors"  # subject: interface; value: rx+tx errors in the window
    # node-wide; value: TCP's retransmitted share of segments sent in the window
    NET_RETRANS = "net.retrans"
    RDMA_PORT = "rdma.port"  # subject: "device/port", e.g. "mlx5_0/1"
    # subject: a peer node of a job here that this node cannot reach over the data
    # network (info: advisory on the reporter; the coordinator weighs every node's word)
    NET_PEER = "net.peer"
    OPERATOR = "operator"  # job-wide: an operator's pause


# The conditions that say a node's network path is faulty: the evidence that makes a node
# the culprit of a hang in which every rank waits in a collective.
LINK_KINDS = frozenset(
    {
        ConditionKind.NET_LINK,
        ConditionKind.NET_FLAP,
        ConditionKind.NET_ERRORS,
        ConditionKind.NET_RETRANS,
        ConditionKind.RDMA_PORT,
    }
)


def condition_key(
    kind: ConditionKind | str, node: str = "", subject: str = "", job: str = ""
) -> str:
    """The one spelling of a condition's identity: ``kind:where[:subject]``, where is the
    node (hardware conditions) or the job (operator conditions)."""
    return ":".join(part for part in (str(kind), node or job, subject) if part)


class Condition(msgspec.Struct, kw_only=True, gc=False):
    """One condition's latest state. A wire struct: unknown fields are ignored, new ones
    get defaults."""

    kind: ConditionKind
    node: str = ""
    job: str = ""  # operator conditions concern a job, not a node
    subject: str = ""  # device, GPU, link or check; empty when node-wide
    active: bool = True
    since: float = msgspec.field(default_factory=time.time)  # wall time it last changed
    severity: Severity = Severity.WARNING
    reason: str = ""  # the evidence, in words: "nvme0n1 latency 405 µs above 100 µs"
    value: float | None = None  # the measured value the reason names, when there is one
    threshold: float | None = None  # what it was compared with

    @property
    def key(self) -> str:
        return condition_key(self.kind, self.node, self.subject, self.job)
