"""``coordinatorctl status``'s node table says why a node is not ready, whoever saw it."""

from __future__ import annotations

import msgspec
from rich.console import Console

from coordinator.ctl.status import render
from proto.node import NodeRecord, NodeState, Telemetry


def rendered(*nodes: NodeRecord) -> str:
    console = Console(record=True, width=200)
    data = {"nodes": [msgspec.to_builtins(n) for n in nodes], "jobs": [], "coordinators": []}
    render(console, data, None)
    return console.export_text()


def row(text: str, node: str) -> str:
    return next(line for line in text.splitlines() if f" {node} " in line)


def test_fault_column_shows_coordinator_faults_then_the_agents_then_drain_reason() -> None:
    text = rendered(
        NodeRecord(id="n-ok", state=NodeState.READY),
        NodeRecord(
            id="n-agent",
            state=NodeState.DEGRADED,
            telemetry=Telemetry(faults=["node.preflight:somaxconn"]),
        ),
        NodeRecord(
            id="n-seen",
            state=NodeState.DEGRADED,
            faults={"nvme": "nvme0n1 latency 900 µs"},
            telemetry=Telemetry(faults=["nvme.latency_spike:nvme0n1"]),
        ),
        NodeRecord(id="n-drain", state=NodeState.DRAINING, drain_reason="clock resync failed"),
    )
    assert "node.preflight:somaxconn" in row(text, "n-agent")
    seen = row(text, "n-seen")
    assert "nvme0n1 latency 900 µs" in seen and "latency_spike" not in seen
    assert "clock resync failed" in row(text, "n-drain")
    assert row(text, "n-ok").rstrip().endswith("│")  # nothing wrong, nothing shown
