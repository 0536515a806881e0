"""Events: a tagged union on ``kind`` covering every kind of the external contract.

Every event carries ``time``, ``severity``, ``node`` and ``job``; each kind adds its own
fields, all with defaults so that older readers and newer writers interoperate. Unknown
fields are ignored on decode (wire structs tolerate additions).
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from proto.conditions import Condition, Severity  # Severity is re-exported from here too


def utcnow() -> datetime:
    return datetime.now(UTC)


class EventBase(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=False):
    time: datetime = msgspec.field(default_factory=utcnow)
    severity: Severity = Severity.INFO
    node: str | None = None
    job: str | None = None
    message: str = ""
    # The condition this event opens or closes (two-state kinds), as the agent's latch
    # holds it: the policy reacts to it and files it under its key.
    condition: Condition | None = None


# -- node lifecycle -------------------------------------------------------------------


class NodeRegistered(EventBase, tag="node.registered"):
    addr: str = ""
    hostname: str = ""
    gpus: int = 0
    simulated: bool = False


class NodeAway(EventBase, tag="node.away"):
    """Its agent missed its heartbeats: not yet lost (an agent restarting, a control link
    down), the job's ranks there judged by their peers' steps (a warning)."""

    last_seen: datetime | None = None
    missed_beats: int = 0


class NodeLost(EventBase, tag="node.lost"):
    """Away, and its job's ranks stopped stepping (or it hosted none and stayed silent
    past the agent-restart grace): gone (critical)."""

    last_seen: datetime | None = None
    missed_beats: int = 0


class NodeSlurm(EventBase, tag="node.slurm"):
    """The coordinator changed the node in Slurm (``action``: ``drained``, ``resumed``)
    or could not (``failed``, a warning with Slurm's own message, retried)."""

    action: str = ""
    reason: str = ""  # the drain's reason in Slurm, or the failure


class NodeDrained(EventBase, tag="node.drained"):
    """The node takes no new work (its life: docs/architecture.md, "A node's life"):
    ``cause`` is what it is drained for (a condition's key, ``node.lost``, or
    ``operator``), ``evidence`` the measured value against its threshold or the
    operator's reason, ``by`` who drained it (``ringmaster``, or the operator's name).
    ``held``: the same kind of fault repeated, so it stays drained until a person
    undrains it (critical); ``history`` says when."""

    cause: str = ""
    evidence: str = ""
    by: str = ""
    held: bool = False
    history: str = ""


class NodeReturned(EventBase, tag="node.returned"):
    """Back in service: ``cause`` is what it was drained for, ``evidence`` how that ended
    (closed, and the health gate passing for ``probation_s``; or an operator's undrain,
    ``by`` naming them)."""

    cause: str = ""
    evidence: str = ""
    probation_s: float = 0.0
    by: str = ""


class NodeCordoned(EventBase, tag="node.cordoned"):
    """An operator cordoned the node (no new placements; its running ranks stay) or lifted
    the cordon (``cordoned`` false)."""

    cordoned: bool = True
    by: str = ""
    reason: str = ""


class PreflightCheck(msgspec.Struct, kw_only=True):
    """One host check. ``required``: a failure refuses the node (a measured shortfall
    the job needs: space, ``/dev/shm``); otherwise it is a warning the node is admitted
    with (a tunable under its recommendation). ``fixed_from``: the value the agent
    replaced with ``value`` at start (empty: nothing changed). Both default so that older
    messages, whose every check was required, still decode as they were meant."""

    name: str
    ok: bool
    value: str = ""
    want: str = ""
    required: bool = True
    fixed_from: str = ""


class NodeRefused(EventBase, tag="node.refused"):
    """Admission passed over a node for a job (an addition to the contract's kinds)."""

    reason: str = ""


class NodePreflight(EventBase, tag="node.preflight"):
    ok: bool = True
    checks: list[PreflightCheck] = msgspec.field(default_factory=list)


# -- GPU ------------------------------------------------------------------------------


class Topology(EventBase, tag="topology"):
    gpus: list[str] = msgspec.field(default_factory=list)
    matrix: list[list[str]] = msgspec.field(default_factory=list)


class TopologyDegraded(EventBase, tag="topology.degraded"):
    gpu_a: int = 0
    gpu_b: int = 0
    expected: str = ""
    found: str = ""
    recovered: bool = False  # True: the pair is back to what was expected


class GpuThermal(EventBase, tag="gpu.thermal"):
    gpu: int = 0
    temp_c: float = 0.0
    level: str = "warning"  # normal | warning | critical
    slowdown_c: float | None = None
    shutdown_c: float | None = None
    reasons: list[str] = msgspec.field(default_factory=list)


class GpuXid(EventBase, tag="gpu.xid"):
    gpu: int = 0
    xid: int = 0


class PcieDegraded(EventBase, tag="pcie.degraded"):
    gpu: int = 0
    tx_gbps: float = 0.0
    rx_gbps: float = 0.0
    expected_gbps: float = 0.0
    replay_count: int = 0
    recovered: bool = False  # True: the link is healthy again


# -- storage --------------------------------------------------------------------------


class NvmeLatencySpike(EventBase, tag="nvme.latency_spike"):
    device: str = ""
    latency_us: float = 0.0
    threshold_us: float = 0.0


class NvmeLatencyRecovered(EventBase, tag="nvme.latency_recovered"):
    device: str = ""
    latency_us: float = 0.0
    threshold_us: float = 0.0
    held_s: float = 0.0


class NvmeReadonly(EventBase, tag="nvme.readonly"):
    device: str = ""
    readonly: bool = True
    source: str = ""  # sysfs | udev | smart


# -- network (additions to the contract's kinds: the "network links" signal) ------------


class NetLink(EventBase, tag="net.link"):
    """The data interface's link went down (``up`` false, critical) or came back."""

    interface: str = ""
    up: bool = False
    carrier: int = 0
    operstate: str = ""


class NetPeer(EventBase, tag="net.peer"):
    """This node could not reach ``peer`` (a node of a job it hosts) at ``addr`` over the
    data network, ``failures`` probes in a row (``reachable`` false), or reaches it again."""

    peer: str = ""
    addr: str = ""  # host:port probed: the peer's probe listener on its data address
    reachable: bool = False
    failures: int = 0
    error: str = ""


class NetFlap(EventBase, tag="net.flap"):
    """A link's carrier changed ``changes`` times within ``window_s`` (warning)."""

    interface: str = ""
    changes: int = 0
    window_s: float = 0.0
    recovered: bool = False  # True: it changed less than the threshold over a window


class NetErrors(EventBase, tag="net.errors"):
    """A link's rx+tx error counters rose by ``errors`` within ``window_s`` (warning)."""

    interface: str = ""
    errors: int = 0
    window_s: float = 0.0
    recovered: bool = False


class NetRetrans(EventBase, tag="net.retrans"):
    """TCP on this node sent ``retrans_segs`` of its ``out_segs`` segments again within
    ``window_s``, a share of ``ratio`` at or over the threshold (warning): its path loses
    packets. ``recovered``: under the threshold over a whole window again."""

    retrans_segs: int = 0
    out_segs: int = 0
    ratio: float = 0.0
    window_s: float = 0.0
    recovered: bool = False


class RdmaPort(EventBase, tag="rdma.port"):
    """An RDMA port left ACTIVE/LinkUp (warning) or came back (``up`` true)."""

    device: str = ""
    port: int = 0
    state: str = ""  # "ACTIVE", "DOWN", ...
    phys_state: str = ""  # "LinkUp", "Polling", ...
    up: bool = False


# -- clock and preemption -------------------------------------------------------------


class ClockDrift(EventBase, tag="clock.drift"):
    offset_ms: float = 0.0
    synced: bool = True
    source: str = ""
    recovered: bool = False  # True: the clock is synchronised and within bounds again


class ClockResynced(EventBase, tag="clock.resynced"):
    """The resync command stepped the clock and it is synchronised and in bounds after."""

    offset_before_ms: float = 0.0
    offset_after_ms: float = 0.0
    offset_measured: bool = True  # False: no offset source answered after the step


class ClockResyncFailed(EventBase, tag="clock.resync_failed"):
    """A resync did not bring the clock back (a warning): the step command is missing or
    failed, or the clock is still unsynchronised or out of bounds after it; the message
    says which. Its own kind, so that no ``clock.resynced`` ever says it failed."""

    offset_before_ms: float = 0.0
    offset_after_ms: float = 0.0
    # False: no offset source answered after the step, so offset_after_ms (0) is no
    # measurement and no evidence against the node
    offset_measured: bool = True
    reason: str = ""  # why it failed: the step command's own word, or the offset after


class SpotNotice(EventBase, tag="spot.notice"):
    provider: str = ""
    action: str = ""
    deadline: datetime | None = None


# -- workers and jobs -----------------------------------------------------------------


class WorkerExited(EventBase, tag="worker.exited"):
    rank: int = 0
    attempt: int = 0
    pid: int = 0
    exit_code: int | None = None
    signal: int | None = None


class WorkerHung(EventBase, tag="worker.hung"):
    """A rank stopped making progress without exiting, found by its node's agent from the
    rank's own beat (:mod:`ringmaster.rankbeat`). ``rank`` and ``node`` name the culprit:
    ranks merely blocked in a collective with it are victims and are not reported."""

    rank: int = 0
    attempt: int = 0
    pid: int = 0
    step: int = 0  # the last step the rank completed
    stalled_s: float = 0.0  # seconds without progress when it was judged hung
    threshold_s: float = 0.0  # what it was judged against
    evidence: str = ""  # what marks it as the culprit (process stopped, beat silent, …)
    stacks: str = ""  # its Python stacks (faulthandler), when they could be captured
    # No rank on this node stands out: every stalled one waits in a collective, so the
    # culprit may be on another node, or be the network (the coordinator decides)
    culprit_unknown: bool = False


class WorkerStraggler(EventBase, tag="worker.straggler"):
    """A rank persistently slower than its peers over a window of steps."""

    rank: int = 0
    attempt: int = 0
    step: int = 0
    step_s: float = 0.0  # the rank's median compute seconds per step over the window
    peer_median_s: float = 0.0
    ratio: float = 0.0  # step_s / peer_median_s
    window_steps: int = 0


class JobSubmitted(EventBase, tag="job.submitted"):
    name: str = ""
    nodes: int = 0
    gpus_per_node: int = 0


class JobStarted(EventBase, tag="job.started"):
    """``resume_step``/``resume_job``: the checkpoint the job starts from and the job that
    wrote it, as ``start`` found it (None: a fresh start)."""

    world_size: int = 0
    nodes: list[str] = msgspec.field(default_factory=list)
    master_addr: str = ""
    master_port: int = 0
    skipped: dict[str, str] = msgspec.field(default_factory=dict)
    resume_step: int | None = None
    resume_job: str = ""


class JobBandwidth(EventBase, tag="job.bandwidth"):
    """The preflight bandwidth check's figures (an addition to the contract's kinds):
    each node's bus bandwidth in GB/s; ``slow``: the nodes refused for it."""

    node_gbps: dict[str, float] = msgspec.field(default_factory=dict)
    median_gbps: float = 0.0
    slow: list[str] = msgspec.field(default_factory=list)


class JobAtRisk(EventBase, tag="job.at_risk"):
    """A preemption notice shorter than the job's measured checkpoint time: the evacuation
    may not make its checkpoint durable in time (an addition to the contract's kinds)."""

    window_s: float = 0.0  # from the notice to the deadline
    checkpoint_s: float = 0.0  # the job's newest checkpoint, from its step to durable
    last_checkpoint_step: int | None = None  # what a failed evacuation falls back to


class JobPending(EventBase, tag="job.pending"):
    """The job cannot be placed now: ``waiting_for`` names each node passed over and why
    (busy nodes aside); inside a scheduler's allocation, ``bound_s`` is how long it waits
    before it stops to be requeued without them."""

    waiting_for: dict[str, str] = msgspec.field(default_factory=dict)
    bound_s: float | None = None


class JobPaused(EventBase, tag="job.paused"):
    step: int = 0
    reason: str = ""


class JobLoop(EventBase, tag="job.loop"):
    """Rank 0 opened the rank API: the framework and the reactions the job's loop has."""

    framework: str = ""
    reactions: list[str] = msgspec.field(default_factory=list)
    lacks: list[str] = msgspec.field(default_factory=list)
    resumed_from: str = ""
    step: int = 0


class JobUnheeded(EventBase, tag="job.unheeded"):
    """A condition that would have made the job react (``reaction``: ``pause``) on a job
    whose loop cannot: what it did instead is in the message (it trains on)."""

    condition_key: str = ""
    reaction: str = ""
    reason: str = ""


class JobResumed(EventBase, tag="job.resumed"):
    step: int = 0
    reason: str = ""


class JobCheckpointed(EventBase, tag="job.checkpointed"):
    step: int = 0
    path: str = ""
    stall_s: float = 0.0


class JobRecovering(EventBase, tag="job.recovering"):
    reason: str = ""
    restarts: int = 0


class JobRestarted(EventBase, tag="job.restarted"):
    restarts: int = 0
    world_size: int = 0
    nodes: list[str] = msgspec.field(default_factory=list)
    from_step: int = 0


class JobShrunk(EventBase, tag="job.shrunk"):
    """The job continues on fewer nodes than it asked for (none healthy to replace one)."""

    world_size: int = 0
    previous_world_size: int = 0
    nodes: list[str] = msgspec.field(default_factory=list)


class JobGrown(EventBase, tag="job.grown"):
    """A shrunk job grows back toward the nodes it asked for."""

    world_size: int = 0
    previous_world_size: int = 0
    nodes: list[str] = msgspec.field(default_factory=list)


class JobRewound(EventBase, tag="job.rewound"):
    """A numeric fault: the job went back to its newest good checkpoint and skips the
    batches that led to the fault."""

    from_step: int = 0  # the step whose loss or gradient norm was bad
    to_step: int = 0  # the checkpoint it went back to
    skip_from: int = 0  # data of steps [skip_from, skip_to) is skipped
    skip_to: int = 0
    reason: str = ""
    rewinds: int = 0  # how many this job has had
    ranks: list[int] = msgspec.field(default_factory=list)  # whose own loss was not finite
    # the one node whose ranks alone computed non-finite values ("": none such)
    suspect: str = ""


class JobCompleted(EventBase, tag="job.completed"):
    step: int = 0


class JobFailed(EventBase, tag="job.failed"):
    reason: str = ""


class JobStopped(EventBase, tag="job.stopped"):
    reason: str = ""
    step: int = 0


# -- control plane --------------------------------------------------------------------


class CoordinatorLeader(EventBase, tag="coordinator.leader"):
    coordinator: str = ""
    epoch: int = 0


class CommandRefused(EventBase, tag="command.refused"):
    command: str = ""
    epoch: int = 0
    current_epoch: int = 0
    reason: str = ""


Event = (
    NodeRegistered
    | NodeAway
    | NodeLost
    | NodeSlurm
    | NodeDrained
    | NodeReturned
    | NodeCordoned
    | NodeRefused
    | NodePreflight
    | Topology
    | TopologyDegraded
    | GpuThermal
    | GpuXid
    | PcieDegraded
    | NvmeLatencySpike
    | NvmeLatencyRecovered
    | NvmeReadonly
    | NetLink
    | NetPeer
    | NetFlap
    | NetErrors
    | NetRetrans
    | RdmaPort
    | ClockDrift
    | ClockResynced
    | ClockResyncFailed
    | SpotNotice
    | WorkerExited
    | WorkerHung
    | WorkerStraggler
    | JobSubmitted
    | JobStarted
    | JobBandwidth
    | JobAtRisk
    | JobPending
    | JobPaused
    | JobLoop
    | JobUnheeded
    | JobResumed
    | JobCheckpointed
    | JobRecovering
    | JobRestarted
    | JobShrunk
    | JobGrown
    | JobRewound
    | JobCompleted
    | JobFailed
    | JobStopped
    | CoordinatorLeader
    | CommandRefused
)


def kind_of(event: EventBase) -> str:
    return str(type(event).__struct_config__.tag)


# What an agent reports about a job's ranks: filed under the reporting node, so that the
# bus' permissions confine an agent to its own node's subjects and the coordinator can
# tell who speaks (:func:`proto.subjects.sender`).
NODE_REPORTED = (WorkerExited, WorkerHung, CommandRefused)


def scope_of(event: EventBase) -> tuple[str, str]:
    """The (scope, id) an event is filed under: what a node reports under that node; the
    coordinators' job events under the job; then nodes; else the cluster."""
    if event.node and isinstance(event, NODE_REPORTED):
        return "node", event.node
    if event.job:
        return "job", event.job
    if event.node:
        return "node", event.node
    return "cluster", "-"
