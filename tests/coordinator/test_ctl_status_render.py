"""``coordinatorctl status``'s node table says why a node is not ready, whoever saw it; its
tables never cut an id, a state or a number, in a narrow terminal or through a pipe."""

from __future__ import annotations

import io

import msgspec
import pytest
from rich.console import Console

from coordinator.ctl.status import left_out, render
from proto.conditions import Condition, ConditionKind, Severity
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
        kind=ConditionKind.PREFLIGHT,
        node="n-pre",
        reason="preflight failed: shm_size 0.1 GB (want >= 8 GB)",
    )
    warned = Condition(
        kind=ConditionKind.PREFLIGHT,
        node="n-warn",
        severity=Severity.INFO,
        reason="preflight passed with warnings: somaxconn 4096 (want >= 65535)",
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
        NodeRecord(id="n-warn", state=NodeState.READY, conditions=[warned]),
        NodeRecord(id="n-spike", state=NodeState.DEGRADED, conditions=[spike]),
        NodeRecord(id="n-drain", state=NodeState.DRAINING, drain_reason="clock resync failed"),
    )
    assert "shm_size 0.1 GB (want >= 8 GB)" in row(text, "n-pre")
    warn = row(text, "n-warn")
    assert "ready" in warn and "somaxconn 4096 (want >= 65535)" in warn, "a ready node's warning"
    seen = row(text, "n-spike")
    assert "nvme0n1 latency 900 µs above 100 µs" in seen and spike.key not in seen
    assert "clock resync failed" in row(text, "n-drain")
    assert row(text, "n-ok").rstrip().endswith("│")  # nothing wrong, nothing shown


def test_a_drained_node_says_who_drained_it_and_why_beside_its_cordon_and_slurms_word() -> None:
    readonly = Condition(
        kind=ConditionKind.NVME_READONLY,
        node="n-ro",
        subject="nvme0n1",
        severity=Severity.CRITICAL,
        reason="nvme0n1 read-only (ro=1)",
    )
    text = rendered(
        NodeRecord(
            id="n-ro",
            state=NodeState.DRAINING,
            conditions=[readonly],
            drain_reason=f"{readonly.key}: nvme0n1 read-only (ro=1)",
            drained_by="ringmaster",
        ),
        NodeRecord(
            id="n-op",
            state=NodeState.DRAINING,
            drain_reason="drained by alice: disk swap",
            drained_by="alice",
            cordoned_by="bob",
        ),
        NodeRecord(
            id="n-held",
            state=NodeState.DRAINING,
            held=True,
            drain_reason="held for a person: nvme.readonly 3 times within 60 min",
        ),
        NodeRecord(id="n-adm", state=NodeState.READY, slurm_drain="admin: fan check"),
    )
    assert row(text, "n-ro").count("read-only (ro=1)") == 1  # the drain is its condition
    op = row(text, "n-op")
    assert "draining, cordoned" in op and "drained by alice: disk swap" in op, op
    assert "cordoned by bob" in op
    assert "draining, held" in row(text, "n-held") and "3 times" in row(text, "n-held")
    assert "drained in Slurm: admin: fan check" in row(text, "n-adm")


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


JOBS = [
    {
        "id": f"tiny-gpt-38f91{i}",
        "state": state,
        "step": 250_000 + i,
        "target_steps": 1_000_000,
        "loss": 2.0,
        "tokens_per_s": 1234567.0,
        "mfu": 0.4712,
        "restarts": 12,
        "pauses": 3,
        "last_checkpoint_step": 249_000,
        "nodes": [f"node-{n}" for n in range(4)],
        "goodput": {"productive": 1.0},
    }
    for i, state in enumerate(("checkpointing", "recovering", "running"))
]
NODES = [
    msgspec.to_builtins(
        NodeRecord(id="gpu-node-0017", state=NodeState.DEGRADED, jobs=[j["id"] for j in JOBS])
    )
]


def job_row(text: str, job: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"│ {job} "))


def shown(width: int | None, wide: bool = False) -> str:
    """What ``status`` prints: to a terminal ``width`` wide, or to a pipe (None)."""
    terminal = width is not None
    console = Console(record=True, width=width, force_terminal=terminal, file=io.StringIO())
    render(console, {"nodes": NODES, "jobs": JOBS, "coordinators": []}, None, wide=wide)
    return console.export_text()


@pytest.mark.parametrize("width", [40, 80, 200, None])
def test_ids_states_and_steps_are_never_cut(width: int | None) -> None:
    text = shown(width)
    for job in JOBS:
        line = job_row(text, job["id"])  # the id whole, on its own row ...
        assert job["state"] in line and f"{job['step']}/1000000" in line  # ... with the rest
    assert "…" not in text
    node = row(text, "gpu-node-0017")
    assert "degraded" in node
    # a node's job list may wrap, between ids, never inside one
    assert all(f" {job['id']}" in text for job in JOBS)


def test_a_narrow_terminal_drops_the_least_important_columns_and_wide_keeps_them() -> None:
    narrow = shown(80)
    assert "restarts" in narrow and "pauses" not in narrow
    assert max(len(line) for line in narrow.splitlines()) <= 80
    for text in (shown(80, wide=True), shown(None)):
        header = next(line for line in text.splitlines() if line.startswith("┃ job "))
        assert all(h in header for h in ("loss", "tok/s", "MFU", "pauses", "ckpt", "nodes"))
    piped = shown(None)
    assert "1,234,567" in job_row(piped, JOBS[0]["id"]) and "node-0, node-1" in piped


def test_one_job_piped_or_narrow_keeps_its_values_whole() -> None:
    reason = "nvme.latency:node-1:nvme0n1 paused the job"
    job = {**JOBS[0], "reason": reason, "pause_reasons": ["nvme.latency:node-1:nvme0n1"]}
    for width in (40, None):
        console = Console(record=True, width=width, force_terminal=width is not None)
        console.file = io.StringIO()
        render(console, job, job["id"])
        text = console.export_text()
        assert "nvme.latency:node-1:nvme0n1" in text and "250000" in text and "…" not in text


def test_a_left_out_node_is_shown_with_why_and_until_when() -> None:
    excluded = {
        "node-1": {"reason": "node node-1 lost", "until": 1_900_000_000.0, "count": 1},
        "node-2": {"reason": "old", "until": 1.0, "count": 1},  # ended: not shown
    }
    shown = left_out(excluded, now=1_800_000_000.0)
    assert shown == "node-1 until 17:46:40 UTC (node node-1 lost)"


def test_a_job_inside_slurm_shows_its_allocation_and_a_pending_requeue() -> None:
    alloc = {"scheduler": "slurm", "job_id": "4242", "hosts": ["gpu-01", "gpu-02"], "restarts": 1}
    job = {**JOBS[0], "state": "stopped", "allocation": alloc, "requeue": True}
    job["spare_nodes"] = ["gpu-02"]
    console = Console(record=True, width=200)
    render(console, job, job["id"])
    text = console.export_text()
    said = "Slurm job 4242 (gpu-01, gpu-02, requeued once); stopped to be requeued"
    assert said in text and "spare_nodes" in text and "gpu-02" in text
    outside = {**JOBS[0], "allocation": None}
    console = Console(record=True, width=200)
    render(console, outside, outside["id"])
    assert "Slurm" not in console.export_text()
