"""``status``: nodes, jobs and coordinators from KV, as tables or JSON."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.segment import Segment, Segments
from rich.table import Table
from rich.text import Text

from coordinator import loop_support
from coordinator.ctl.bus import Session
from coordinator.ctl.errors import CtlError
from proto.conditions import condition_key
from proto.job import GOODPUT_BUCKETS, Allocation, JobRecord
from proto.node import CoordinatorRecord, NodeRecord
from proto.progress import Reaction


def job_view(job: JobRecord) -> dict[str, Any]:
    """The public shape of one job: the contract's fields first, then the rest. A job whose
    loop reports no steps has ``step`` null (unknown, not 0), and its ledger's running time
    is ``unknown`` rather than productive (``reports_steps`` false)."""
    known = loop_support.reports_steps(job)
    has = loop_support.reactions(job)
    out: dict[str, Any] = {
        "id": job.id,
        "name": job.name,
        "state": job.state.value,
        "step": job.step if known else None,
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
        "reports_steps": known,
        "framework": job.loop.framework
        if job.loop
        else ("builtin" if not job.spec.job.entry else None),
        "reactions": [r.value for r in has],
        "lacks": [r.value for r in Reaction if r not in has],
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


def render(console: Console, data: Any, job_id: str | None, *, wide: bool = False) -> None:
    """Tables that never cut an id, a state or a number (see :func:`_print`)."""
    if job_id:
        render_job(console, data)
        return
    rows = []
    for n in data["nodes"]:
        tel = n["telemetry"]
        nvme = " ".join(f"{v:.0f}" for v in tel["nvme_latency_us"].values()) or "-"
        temps = " ".join(f"{g['temp_c']:.0f}" for g in tel["gpus"] if g.get("temp_c")) or "-"
        clock = f"{tel['clock_offset_ms']:.2f}" if tel.get("clock_offset_ms") is not None else "-"
        flags = [f for f, on in (("held", n.get("held")), ("cordoned", n.get("cordoned_by"))) if on]
        rows.append(
            [
                n["id"],
                ", ".join([_state(n["state"]), *flags]),
                str(n["gpus"]),
                nvme,
                temps,
                clock,
                ", ".join(n["jobs"]) or "-",
                node_notes(n),
            ]
        )
    _print(console, "nodes", _NODE_COLUMNS, rows, wide)
    rows = [
        [
            j["id"],
            _state(j["state"]),
            f"{_or_unknown(j['step'])}/{j['target_steps'] or '?'}",
            f"{j['loss']:.3f}" if j["loss"] is not None else "-",
            f"{j['tokens_per_s']:,.0f}" if j.get("tokens_per_s") else "-",
            f"{100 * j['mfu']:.1f} %" if j.get("mfu") is not None else "-",
            str(j["restarts"]),
            str(j["pauses"]),
            str(j["last_checkpoint_step"] or "-"),
            ", ".join(j["nodes"]) or "-",
            _productive(j["goodput"]) if j.get("reports_steps", True) else "?",
        ]
        for j in data["jobs"]
    ]
    _print(console, "jobs", _JOB_COLUMNS, rows, wide)
    for c in data["coordinators"]:
        age = time.time() - c["updated_at"]
        console.print(f"{c['id']}: {c['role']} (epoch {c['epoch']}, seen {age:.0f} s ago)")


def node_notes(n: dict[str, Any]) -> str:
    """Why a node is not ready, whoever says so: why it drains (who drained it, its hold,
    its probation) unless that is one of its conditions; its agent's open conditions (the
    evidence, advisory ones on a ready node too: what it runs with); its cordon; a drain
    in Slurm someone else set."""
    conditions = n["conditions"]
    keys = {condition_key(c["kind"], c.get("node", ""), c.get("subject", "")) for c in conditions}
    drain = n.get("drain_reason") or ""
    notes = [drain] if drain and drain.split(": ", 1)[0] not in keys else []
    notes += [c["reason"] or c["kind"] for c in conditions]
    if n.get("cordoned_by"):
        notes.append(f"cordoned by {n['cordoned_by']}")
    if n.get("slurm_drain"):
        notes.append(f"drained in Slurm: {n['slurm_drain']}")
    return "; ".join(notes)


def left_out(excluded: dict[str, Any], now: float) -> str:
    """Nodes still left out of the job after a fault: why, and until when (UTC)."""
    return "; ".join(
        f"{node} until {datetime.fromtimestamp(e['until'], UTC):%H:%M:%S} UTC ({e['reason']})"
        for node, e in sorted(excluded.items())
        if e["until"] > now
    )


def _allocation(alloc: dict[str, Any], requeue: bool) -> str:
    """The Slurm job a job runs inside, in words."""
    said = str(msgspec.convert(alloc, Allocation))
    return said + ("; stopped to be requeued" if requeue else "")


def render_job(console: Console, j: dict[str, Any]) -> None:
    table = Table(show_header=False, title=f"job {j['id']}", title_justify="left")
    table.add_column("field", style="bold", no_wrap=True)
    cells = []
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
        "unheeded",
        "reactions",
        "lacks",
        "phase",
        "last_checkpoint_step",
        "world_size",
        "nodes",
        "spare_nodes",
        "excluded",
        "master_addr",
        "allocation",
        "reason",
    ):
        value = j.get(key)
        if key == "allocation" and value:
            value = _allocation(value, bool(j.get("requeue")))
        elif key == "excluded":
            value = left_out(value or {}, time.time())
        elif key == "state":
            value = _state(str(value))
        elif key == "mfu" and value is not None:
            value = f"{100 * value:.1f} %"
        elif key == "tokens_per_s" and value is not None:
            value = f"{value:,.0f}"
        elif key == "step" and value is None and not j.get("reports_steps", True):
            value = "unknown (its loop reports no steps)"
        elif key == "phase" and value:
            value = (
                f"{value['name']} since {datetime.fromtimestamp(value['since'], UTC):%H:%M:%S} UTC"
            )
        elif isinstance(value, list):
            value = ", ".join(value)
        cells.append((key, "-" if value in (None, "") else str(value)))
    longest = max(cell_len(w) for _, v in cells for w in Text.from_markup(v).plain.split())
    table.add_column("value", min_width=longest)  # wraps between words, never inside one
    for key, value in cells:
        table.add_row(key, value)
    _emit(console, _lines(console, table))
    ledger = Table(title="goodput (GPU-seconds)", title_justify="left")
    ledger.add_column("bucket")
    ledger.add_column("GPU-s", justify="right")
    ledger.add_column("%", justify="right")
    phases = {f"{name} (phase)": secs for name, secs in (j.get("phases") or {}).items()}
    buckets = {**j["goodput"], **phases}
    total = sum(buckets.values()) or 1.0
    for bucket, secs in buckets.items():
        ledger.add_row(bucket, f"{secs:.1f}", f"{100 * secs / total:.1f}")
    _emit(console, _lines(console, ledger))
    if not j.get("reports_steps", True):
        console.print(
            "the split of the running time is unknown: the job's loop reports no steps, so "
            "training and redone work cannot be told apart (open the rank API to measure it)"
        )


@dataclass(frozen=True)
class Column:
    """One column of a list table. ``drop`` orders what a narrow terminal loses first
    (highest first; 0 never goes); ``wraps`` marks free text, which may wrap. Every other
    cell (ids, states, numbers) prints whole, so a log or a paste keeps what matters."""

    header: str
    drop: int = 0
    wraps: bool = False


_NODE_COLUMNS = (
    Column("node"),
    Column("state"),
    Column("GPUs", drop=3),
    Column("NVMe µs", drop=5),
    Column("GPU °C", drop=4),
    Column("clock ms", drop=6),
    Column("jobs", drop=2, wraps=True),
    Column("conditions", drop=1, wraps=True),
)
_JOB_COLUMNS = (
    Column("job"),
    Column("state"),
    Column("step"),
    Column("loss", drop=3),
    Column("tok/s", drop=4),
    Column("MFU", drop=5),
    Column("restarts", drop=2),
    Column("pauses", drop=7),
    Column("ckpt", drop=6),
    Column("nodes", drop=8, wraps=True),
    Column("productive %", drop=1),
)


def _print(
    console: Console, title: str, columns: Sequence[Column], rows: list[list[str]], wide: bool
) -> None:
    """Print a list table the way ``kubectl get`` does: in a terminal too narrow for every
    column, drop the least important ones (``--wide`` keeps them) and wrap free text; when
    stdout is not a terminal, print every column at its full width. A table whose kept
    columns are wider than the terminal is printed wider (the terminal wraps the lines)
    rather than cutting a cell."""
    full = wide or not console.is_terminal
    shown = list(range(len(columns)))
    while True:
        table = _table(title, [columns[i] for i in shown], [[r[i] for r in rows] for i in shown])
        lines = _lines(console, table)
        droppable = [i for i in shown if columns[i].drop]
        if full or not droppable or max(map(Segment.get_line_length, lines)) <= console.width:
            break
        shown.remove(max(droppable, key=lambda i: columns[i].drop))
    _emit(console, lines)


def _lines(console: Console, table: Table) -> list[list[Segment]]:
    """The table's lines at the terminal's width (at its natural width when stdout is not a
    terminal), as rendered: rich may lay cells with a ``min_width`` out wider than asked."""
    need = Measurement.get(console, console.options.update_width(_UNBOUNDED), table)
    # never under the table's minimum: there rich would shrink kept cells, down to nothing
    width = max(need.minimum, console.width) if console.is_terminal else need.maximum
    return list(Segment.split_lines(console.render(table, console.options.update_width(width))))


def _emit(console: Console, lines: list[list[Segment]]) -> None:
    """Uncropped: kept cells wider than the terminal make longer lines, which it wraps."""
    console.print(Segments(seg for line in lines for seg in [*line, Segment.line()]), crop=False)


def _table(title: str, columns: Sequence[Column], cells: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for col, values in zip(columns, cells, strict=True):
        plain = [col.header] + [Text.from_markup(v).plain for v in values]
        # free text wraps between words, never inside one (an id in a list stays whole)
        words = [w for text in plain for w in text.split()] if col.wraps else plain
        table.add_column(col.header, no_wrap=not col.wraps, min_width=max(map(cell_len, words)))
    for row in zip(*cells, strict=True):
        table.add_row(*row)
    return table


_UNBOUNDED = 1 << 16


_COLOURS = {
    "ready": "green",
    "running": "green",
    "completed": "green",
    "degraded": "yellow",
    "paused": "yellow",
    "recovering": "yellow",
    "draining": "yellow",
    "away": "yellow",
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


def _or_unknown(value: Any) -> str:
    return "?" if value is None else str(value)


def _productive(goodput: dict[str, float]) -> str:
    total = sum(goodput.values())
    return f"{100 * goodput.get('productive', 0.0) / total:.0f}" if total else "-"
