"""``coordinatorctl status``'s node table says why a node is not ready, whoever saw it."""

from __future__ import annotations

import msgspec
from rich.console import Console

from coordinator.ctl.status import render
from proto.conditions import Condition, ConditionKind
from proto.node import NodeRecord, NodeState


def rendered(*nodes: NodeRecord) -> str:
    console = Console(record=True, width=200)
    data = {"nodes": [msgspec.to_builtins(n) for n in nodes], "jobs": [], "coordinators": []}
    render(console, data, None)
    return console.export_text()


def row(text: str, node: str) -> str:
    return next(line for line in text.splitlines() if f" {node} " in line)


def test_conditions_column_shows_the_evidence_then_the_drain_reason() -> None:
    preflight = Condition(
        kind=ConditionKind.PREFLIGHT, node="n-pre", reason="somaxconn 128 (want >= 65535)"
    )
    spike = Condition(
        kind=ConditionKind.NVME_LATENCY,
        node="n-spike",
        subject="nvme0n1",
        reason="nvme0n1 latency 900 µs above 100 µs",
    )
    text = rendered(
        NodeRecord(id="n-ok", state=NodeState.READY),
        NodeRecord(id="n-pre", state=NodeState.DEGRADED, conditions=[preflight]),
        NodeRecord(id="n-spike", state=NodeState.DEGRADED, conditions=[spike]),
        NodeRecord(id="n-drain", state=NodeState.DRAINING, drain_reason="clock resync failed"),
    )
    assert "somaxconn 128 (want >= 65535)" in row(text, "n-pre")
    seen = row(text, "n-spike")
    assert "nvme0n1 latency 900 µs above 100 µs" in seen and spike.key not in seen
    assert "clock resync failed" in row(text, "n-drain")
    assert row(text, "n-ok").rstrip().endswith("│")  # nothing wrong, nothing shown


def test_jobs_table_shows_speed_and_mfu_where_known() -> None:
    console = Console(record=True, width=200)
    job = {
        "id": "j-1",
        "state": "running",
        "step": 5,
        "target_steps": 10,
        "loss": 2.0,
        "tokens_per_s": 123456.0,
        "mfu": 0.4712,
        "restarts": 0,
        "pauses": 0,
        "last_checkpoint_step": None,
        "nodes": ["node-0"],
        "goodput": {"productive": 1.0},
    }
    cpu = {**job, "id": "j-2", "mfu": None}
    render(console, {"nodes": [], "jobs": [job, cpu], "coordinators": []}, None)
    text = console.export_text()
    assert "123,456" in row(text, "j-1") and "47.1 %" in row(text, "j-1")
    assert "47.1" not in row(text, "j-2") and "123,456" in row(text, "j-2")
