"""The node registry, fed by heartbeats and node events. Pure: callers pass the time."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto.node import Heartbeat, NodeState, Telemetry


@dataclass
class NodeInfo:
    id: str
    addr: str = ""
    hostname: str = ""
    gpus: int = 0
    cpus: int = 0
    simulated: bool = False
    state: NodeState = NodeState.READY
    last_seen: float = 0.0  # coordinator's monotonic clock
    interval_s: float = 1.0
    preflight_ok: bool = True
    topology_ok: bool = True
    telemetry: Telemetry = field(default_factory=Telemetry)
    jobs: list[str] = field(default_factory=list)
    faults: dict[str, str] = field(default_factory=dict)  # active fault → description
    drain_reason: str = ""

    @property
    def healthy(self) -> bool:
        return self.state is NodeState.READY and self.preflight_ok and self.topology_ok


class Registry:
    def __init__(self, missed_beats: int = 3) -> None:
        self.nodes: dict[str, NodeInfo] = {}
        self.missed_beats = missed_beats

    def observe(self, beat: Heartbeat, now: float) -> tuple[NodeInfo, bool]:
        """Record a heartbeat. Returns the node and whether it is new or back from lost."""
        node = self.nodes.get(beat.node)
        fresh = node is None or node.state is NodeState.LOST
        if node is None:
            node = self.nodes[beat.node] = NodeInfo(id=beat.node)
        node.addr, node.hostname, node.gpus = beat.addr, beat.hostname, beat.gpus
        node.cpus = beat.cpus
        node.simulated, node.interval_s = beat.simulated, beat.interval_s
        node.preflight_ok, node.topology_ok = beat.preflight_ok, beat.topology_ok
        node.telemetry, node.jobs, node.last_seen = beat.telemetry, beat.jobs, now
        if node.state in (NodeState.LOST, NodeState.READY, NodeState.DEGRADED):
            # the agent's own view of what is wrong counts as much as the events seen here
            faulty = bool(node.faults or beat.telemetry.faults)
            node.state = NodeState.DEGRADED if faulty else NodeState.READY
        return node, fresh

    def sweep(self, now: float) -> list[NodeInfo]:
        """Mark nodes lost after ``missed_beats`` intervals of silence; return the new ones."""
        lost = []
        for node in self.nodes.values():
            silent = now - node.last_seen
            if node.state is not NodeState.LOST and silent > self.missed_beats * node.interval_s:
                node.state = NodeState.LOST
                lost.append(node)
        return lost

    def set_fault(self, node_id: str, key: str, description: str | None) -> None:
        """A fault opened (description) or closed (None) on a node; drives ready/degraded."""
        node = self.nodes.get(node_id)
        if node is None:
            return
        if description is None:
            node.faults.pop(key, None)
        else:
            node.faults[key] = description
        if node.state in (NodeState.READY, NodeState.DEGRADED):
            faulty = bool(node.faults or node.telemetry.faults)
            node.state = NodeState.DEGRADED if faulty else NodeState.READY

    def drain(self, node_id: str, reason: str) -> None:
        node = self.nodes.get(node_id)
        if node is not None and node.state is not NodeState.LOST:
            node.state, node.drain_reason = NodeState.DRAINING, reason
