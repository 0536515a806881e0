"""What the coordinator knows of one node: its agent's newest beat, the conditions
mirrored from it, and what only the coordinator adds (silence, its life). Filled by
:class:`coordinator.registry.Registry`; its life's fields by
:class:`coordinator.node_keeper.NodeKeeper`."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from proto.conditions import Condition, ConditionKind, Severity
from proto.node import NodeState, RankReport, Telemetry

_telemetry = msgspec.json.Decoder(Telemetry)


@dataclass
class NodeInfo:
    id: str
    addr: str = ""
    hostname: str = ""
    gpus: int = 0
    cpus: int = 0
    simulated: bool = False
    state: NodeState = NodeState.READY
    last_seen: float = 0.0  # coordinator's monotonic clock (a bus outage's end moves it too)
    beat_seen: float = 0.0  # when the newest beat arrived, coordinator's monotonic clock
    beat_sent_at: float = 0.0  # the agent's wall clock when it sent the newest beat
    interval_s: float = 1.0
    jobs: tuple[str, ...] = ()
    conditions: dict[str, Condition] = field(default_factory=dict)  # active, by key
    # Its life (coordinator.node_life, kept by coordinator.node_keeper): why it takes no
    # work ("" in service), who drained it, who cordoned it, whether it is held, when its
    # probation ends, what Slurm's drain must say (key, evidence; None: no drain)
    drain_reason: str = ""
    drained_by: str = ""
    cordoned_by: str = ""
    held: bool = False
    probation_until: float | None = None
    # when its life last returned it to service (wall seconds; None: not serving)
    serving_since: float | None = None
    slurm_cause: tuple[str, str] | None = None
    # the coordinator's own judgements on an open condition (a clock a resync could not
    # bring back): key → evidence, a cause of a drain while that condition stays open
    judged: dict[str, str] = field(default_factory=dict)
    # the coordinator's verdict that holds the node for a person (its ranks alone computed
    # non-finite values again and again): the evidence, until the node keeper has taken it
    hold_for: str = ""
    slurm_drain: str = ""  # a drain in Slurm someone else set: its reason
    lost_reason: str = ""  # why it was declared lost, besides its silence
    # while away: when a job last showed its ranks there still stepping (coordinator's
    # monotonic clock); the grace before it is lost counts from then
    vouched_at: float = 0.0
    metrics_url: str = ""  # the agent's Prometheus endpoint
    # when its agent failed to answer a ping (coordinator's monotonic clock); a beat
    # received after it clears it
    suspect_at: float | None = None
    ranks: tuple[RankReport, ...] = ()  # the agent's, as of its newest beat
    # per job, the attempt whose launch the agent had carried out when it built its newest
    # beat (None: it does not say); see coordinator.reconcile.knows_launch
    launched: dict[str, int] | None = None
    # counts the changes of what ``ranks`` says of each rank but its step (which rank of
    # which attempt, its pid, alive or how it exited): equal, and a reconciliation's
    # findings about this node are what they were
    ranks_version: int = 0
    _ranks_key: tuple[tuple[object, ...], ...] = field(default=(), repr=False)
    agent_started_at: float = 0.0  # when its agent process started (a new value: restarted)
    probe_port: int = 0  # its agent's peer-probe listener on ``addr`` (0: none)
    probe_confirm_s: float = 0.0  # how long its probes take to find a peer unreachable
    # the newest change each event brought, by key, until a beat sent after it arrives
    _news: dict[str, Condition] = field(default_factory=dict, repr=False)
    # the newest beat's conditions, while ``conditions`` is still the mirror made of them
    _beat_conditions: tuple[Condition, ...] | None = field(default=None, repr=False)
    # the newest beat's telemetry: as sent (JSON), until something reads it
    _telemetry: Telemetry | msgspec.Raw = field(default_factory=Telemetry, repr=False)
    telemetry_error: str = ""  # why the newest beat's telemetry could not be read

    @property
    def telemetry(self) -> Telemetry:
        """The newest beat's telemetry, decoded on first read; an empty one, with
        ``telemetry_error`` saying why, when what the node sent is not telemetry."""
        if isinstance(self._telemetry, msgspec.Raw):
            raw, self._telemetry, self.telemetry_error = self._telemetry, Telemetry(), ""
            if len(raw):
                try:
                    self._telemetry = _telemetry.decode(raw)
                except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
                    self.telemetry_error = f"its telemetry is malformed: {exc}"
        return self._telemetry

    @property
    def preflight_ok(self) -> bool:
        """No required preflight check fails (warnings alone are advisory)."""
        return not any(c.kind is ConditionKind.PREFLIGHT for c in self.faults())

    @property
    def topology_ok(self) -> bool:
        return not any(c.kind is ConditionKind.TOPOLOGY for c in self.conditions.values())

    @property
    def healthy(self) -> bool:
        """It may take new ranks: ready, answering, not cordoned."""
        return self.state is NodeState.READY and self.suspect_at is None and not self.cordoned_by

    def faults(self) -> list[Condition]:
        """The open conditions that count against the node: all but the advisory ones."""
        return [c for c in self.conditions.values() if c.severity is not Severity.INFO]

    def why_not_healthy(self) -> str:
        """The evidence, in words: the faults' reasons, else why it drains."""
        reasons = [c.reason or c.key for c in self.faults()]
        if self.suspect_at is not None and not reasons:
            return "its agent did not answer a ping; waiting for its next heartbeat"
        return "; ".join(reasons) or self.drain_reason

    def settle(self) -> None:
        """Its state from what is known of it (silence aside): draining while its life
        says so, else degraded with a fault open, else ready."""
        if self.state in (NodeState.READY, NodeState.DEGRADED, NodeState.DRAINING):
            self.state = (
                NodeState.DRAINING
                if self.drain_reason
                else NodeState.DEGRADED
                if self.faults()
                else NodeState.READY
            )
