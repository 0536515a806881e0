"""``status``: nodes, jobs and coordinators from KV, as tables or JSON."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from coordinator.ctl.bus import Session
from coordinator.ctl.errors import CtlError
from proto.job import GOODPUT_BUCKETS, JobRecord
from proto.node import CoordinatorRecord, NodeRecord


def job_view(job: JobRecord) -> dict[str, Any]:
    """The public shape of one job: the contract's fields first, then the rest."""
    out: dict[str, Any] = {
        "id": job.id,
        "name": job.name,
        "state": job.state.value,
        "step": job.step,
        "target_steps": job.target_steps,
        "restarts": job.restarts,
        "pauses": job.pauses,
        "last_checkpoint_step": job.last_checkpoint_step,
        "world_size": job.world_size,
        "nodes": job.nodes,
        "loss": job.loss,
        "tokens_per_s": job.tokens_per_s,
        "mfu": job.mfu,
        "goodput": {b: round(job.goodput.get(b, 0.0), 3) for b in GOODPUT_BUCKETS},
    }
    extra = msgspec.to_builtins(job)
    for key in ("spec", "exited_ranks", "accounted_at"):
        extra.pop(key, None)
    return {**out, **{k: v for k, v in extra.items() if k not in out}}


async def gather(s: Session) -> tuple[list[NodeRecord], list[JobRecord], list[CoordinatorRecord]]:
    nodes = sorted(await s.records("nodes", NodeRecord), key=lambda n: n.id)
    jobs = sorted(await s.records("jobs", JobRecord), key=lambda j: j.submitted_at)
    coordinators = sorted(await s.records("coordinators", CoordinatorRecord), key=lambda c: c.id)
    return nodes, jobs, coordinators


async def status_json(s: Session, job_id: str | None) -> Any:
    if job_id:
        job = await s.record("jobs", job_id, JobRecord)
        if job is None:
            raise CtlError(f"no job {job_id!r} in cluster {s.cluster!r}", code=2)
        return job_view(job)
    nodes, jobs, coordinators = await gather(s)
    return {
        "nodes": [msgspec.to_builtins(n) for n in nodes],
        "jobs": [job_view(j) for j in jobs],
        "coordinators": [
            {**msgspec.to_builtins(c), "leader": c.role == "leader"} for c in coordinators
        ],
    }


def render(console: Console, data: Any, job_id: str | None) -> None:
    if job_id:
        render_job(console, data)
        return
    table = Table(title="nodes", title_justify="left")
    for col in ("node", "state", "GPUs", "NVMe µs", "GPU °C", "clock ms", "jobs", "conditions"):
        table.add_column(col)
    for n in data["nodes"]:
        tel = n["telemetry"]
        nvme = " ".join(f"{v:.0f}" for v in tel["nvme_latency_us"].values()) or "-"
        temps = " ".join(f"{g['temp_c']:.0f}" for g in tel["gpus"] if g.get("temp_c")) or "-"
        clock = f"{tel['clock_offset_ms']:.2f}" if tel.get("clock_offset_ms") is not None else "-"
        # why a node is not ready: its agent's open conditions (the evidence), else why
        # the coordinator drains it
        faults = "; ".join(c["reason"] or c["kind"] for c in n["conditions"])
        faults = faults or n.get("drain_reason") or ""
        table.add_row(
            n["id"],
            _state(n["state"]),
            str(n["gpus"]),
            nvme,
            temps,
            clock,
            ",".join(n["jobs"]) or "-",
            faults,
        )
    console.print(table)
    jobs = Table(title="jobs", title_justify="left")
    for col in (
        "job",
        "state",
        "step",
        "loss",
        "tok/s",
        "MFU",
        "restarts",
        "pauses",
        "ckpt",
        "nodes",
        "productive %",
    ):
        jobs.add_column(col)
    for j in data["jobs"]:
        jobs.add_row(
            j["id"],
            _state(j["state"]),
            f"{j['step']}/{j['target_steps']}",
            f"{j['loss']:.3f}" if j["loss"] is not None else "-",
            f"{j['tokens_per_s']:,.0f}" if j.get("tokens_per_s") else "-",
            f"{100 * j['mfu']:.1f} %" if j.get("mfu") is not None else "-",
            str(j["restarts"]),
            str(j["pauses"]),
            str(j["last_checkpoint_step"] or "-"),
            ",".join(j["nodes"]) or "-",
            _productive(j["goodput"]),
        )
    console.print(jobs)
    for c in data["coordinators"]:
        age = time.time() - c["updated_at"]
        console.print(f"{c['id']}: {c['role']} (epoch {c['epoch']}, seen {age:.0f} s ago)")


def render_job(console: Console, j: dict[str, Any]) -> None:
    table = Table(show_header=False, title=f"job {j['id']}", title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    for key in (
        "state",
        "step",
        "target_steps",
        "loss",
        "tokens_per_s",
        "mfu",
        "compile_s",
        "restarts",
        "pauses",
        "pause_reasons",
        "last_checkpoint_step",
        "world_size",
        "nodes",
        "master_addr",
        "reason",
    ):
        value = j.get(key)
        if key == "state":
            value = _state(str(value))
        elif key == "mfu" and value is not None:
            value = f"{100 * value:.1f} %"
        elif key == "tokens_per_s" and value is not None:
            value = f"{value:,.0f}"
        elif isinstance(value, list):
            value = ", ".join(value)
        table.add_row(key, "-" if value in (None, "") else str(value))
    console.print(table)
    ledger = Table(title="goodput (GPU-seconds)", title_justify="left")
    ledger.add_column("bucket")
    ledger.add_column("GPU-s", justify="right")
    ledger.add_column("%", justify="right")
    total = sum(j["goodput"].values()) or 1.0
    for bucket, secs in j["goodput"].items():
        ledger.add_row(bucket, f"{secs:.1f}", f"{100 * secs / total:.1f}")
    console.print(ledger)


_COLOURS = {
    "ready": "green",
    "running": "green",
    "completed": "green",
    "degraded": "yellow",
    "paused": "yellow",
    "recovering": "yellow",
    "draining": "yellow",
    "checkpointing": "cyan",
    "starting": "cyan",
    "pending": "cyan",
    "lost": "red",
    "failed": "red",
    "stopped": "magenta",
}


def _state(state: str) -> str:
    colour = _COLOURS.get(state)
    return f"[{colour}]{state}[/{colour}]" if colour else state


def _productive(goodput: dict[str, float]) -> str:
    total = sum(goodput.values())
    return f"{100 * goodput.get('productive', 0.0) / total:.0f}" if total else "-"
