"""Heartbeats and telemetry a node agent publishes every beat."""

from __future__ import annotations

import enum

import msgspec

from proto.conditions import Condition


class NodeState(enum.StrEnum):
    """ready → degraded (a warning open) → ready; draining (no new ranks: a critical
    condition open, an operator's drain, a probation after either, a hold; see
    coordinator.node_life); away (its agent missed 3 heartbeats: restarting, or cut off
    from the bus, or gone) → lost (the job's ranks there stopped stepping, or no ranks and
    silent past the agent-restart grace) → back on the next heartbeat (from away too),
    lost ones through a probation."""

    READY = "ready"
    DEGRADED = "degraded"
    DRAINING = "draining"
    AWAY = "away"
    LOST = "lost"


class GpuSample(msgspec.Struct, kw_only=True, gc=False):
    index: int
    temp_c: float | None = None
    util_pct: float | None = None
    mem_used_mb: float | None = None


class Telemetry(msgspec.Struct, kw_only=True, gc=False):
    nvme_latency_us: dict[str, float] = msgspec.field(default_factory=dict)
    gpus: tuple[GpuSample, ...] = ()
    clock_offset_ms: float | None = None


class CollectorStatus(msgspec.Struct, kw_only=True, gc=False):
    name: str
    ok: bool
    duration_s: float = 0.0
    error: str = ""


class RankReport(msgspec.Struct, kw_only=True, gc=False):
    """One rank as its node's agent knows it now: the authoritative word on whether it
    runs. A rank that exited stays reported, with its code, until the agent launches the
    next attempt of its job (or forgets the job: ``RANK_MEMORY_S``)."""

    job: str
    rank: int
    attempt: int
    pid: int
    alive: bool
    # Set once the rank exited: its code, or the signal that ended it; both None when it
    # exited while no agent was its parent and it left no exit record (code unknown).
    exit_code: int | None = None
    signal: int | None = None
    last_step: int = 0  # the last step its beat reported (0: none yet)


RANK_MEMORY_S = 600.0  # how long an agent keeps reporting a job whose ranks all exited


class _Beat(msgspec.Struct, kw_only=True, gc=False):
    """A heartbeat's fields that every reader decodes whole (see :class:`Heartbeat`)."""

    node: str
    seq: int
    sent_at: float
    addr: str = ""
    hostname: str = ""
    gpus: int = 0
    cpus: int = 0  # cores ranks may be pinned to; 0 = no pinning (simulated nodes share a host)
    simulated: bool = False
    interval_s: float = 1.0
    # The node's authoritative set of active conditions (its detectors' latches): a
    # coordinator that missed an event catches up on the next beat.
    conditions: tuple[Condition, ...] = ()
    jobs: tuple[str, ...] = ()
    metrics_url: str = ""  # the agent's Prometheus endpoint; empty when it serves none
    # Every rank this agent runs or ran (see RankReport): the coordinator reconciles each
    # job's expected ranks against these, so a missed worker.exited costs one beat.
    ranks: tuple[RankReport, ...] = ()
    # Per job, the newest attempt whose launch this agent had carried out when it built
    # this beat: every rank of that attempt it started is in ``ranks``. Only such a beat
    # says a rank of that attempt is not here, however late it arrives. None: the agent
    # does not say (an older one); the coordinator then compares clocks.
    launched: dict[str, int] | None = None
    # When this agent process started (wall time): a new value is a restarted agent.
    started_at: float = 0.0
    # The TCP port of the agent's peer-probe listener on ``addr`` (0: none): the job's
    # other nodes connect to it to tell a partition from a hang (nodeagent.peer_probe)
    probe_port: int = 0
    # s: how long its probes take at most to find a peer unreachable (0: it probes none);
    # the coordinator waits that long for the network's word on a hang no node can pin
    probe_confirm_s: float = 0.0


class Heartbeat(_Beat, kw_only=True, gc=False):
    """What an agent publishes every beat (``subjects.heartbeat``)."""

    telemetry: Telemetry = msgspec.field(default_factory=Telemetry)
    collectors: tuple[CollectorStatus, ...] = ()


class NodeBeat(_Beat, kw_only=True, gc=False):
    """The coordinator's reading of a :class:`Heartbeat`, the same JSON: its telemetry
    kept as the JSON it came as, decoded only when the node's record is written (at most
    every few seconds, while a beat comes every second), and its collector statuses (the
    node's own metrics show them) skipped unread. A beat's decoding then costs what the
    coordinator acts on, not what the node's telemetry carries."""

    telemetry: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class ClockProbe(msgspec.Struct, kw_only=True):
    """An agent's clock probe (``subjects.clock``): ``t1`` is its send time."""

    t1: float


class ClockReply(msgspec.Struct, kw_only=True):
    """The responder's receive (``t2``) and send (``t3``) times, NTP's naming."""

    t1: float
    t2: float
    t3: float


class NodeRecord(msgspec.Struct, kw_only=True):
    """A node as the leading coordinator sees it (KV; ``status`` reads it)."""

    id: str
    state: NodeState
    addr: str = ""
    hostname: str = ""
    gpus: int = 0
    simulated: bool = False
    last_seen: float = 0.0
    telemetry: Telemetry = msgspec.field(default_factory=Telemetry)
    conditions: list[Condition] = msgspec.field(default_factory=list)  # the agent's, mirrored
    jobs: list[str] = msgspec.field(default_factory=list)
    drain_reason: str = ""  # why it takes no work (draining), in words
    drained_by: str = ""  # "ringmaster" (its evidence) or the operator who drained it
    cordoned_by: str = ""  # the operator who cordoned it ("": not cordoned)
    held: bool = False  # its faults repeat: drained until a person undrains it
    probation_until: float | None = None  # wall time it takes work again, gate passing
    slurm_drain: str = ""  # a drain in Slurm someone else set: its reason
    preflight_ok: bool = True  # no required preflight check failing
    topology_ok: bool = True  # no topology.degraded condition active
    metrics_url: str = ""  # the agent's Prometheus endpoint, from its heartbeat


class CoordinatorRecord(msgspec.Struct, kw_only=True):
    id: str
    role: str
    epoch: int = 0
    pid: int = 0
    updated_at: float = 0.0
    metrics_url: str = ""  # the coordinator's Prometheus endpoint; empty when it serves none
