"""``report JOB``: the goodput ledger in GPU-hours and money, what each fault cost and what
the reaction saved (estimated; see :mod:`.report_model`), and a timeline as HTML. Read
from the job record in KV and a replay of the event and progress streams, so it works
after the job has ended."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from coordinator.ctl.bus import Session
from coordinator.ctl.errors import CtlError
from coordinator.ctl.report_html import html
from coordinator.ctl.report_model import ESTIMATES, Report, build
from proto import subjects
from proto.codec import decode_event, progress_decoder
from proto.events import EventBase, JobRestarted, JobStarted
from proto.job import JobRecord
from proto.progress import StepDone

REPLAY_WAIT_S = 2.0  # an empty replay ends after this long without a message
SLACK_S = 60.0  # node events this long around the job's span may still concern it


async def report(
    s: Session, job_id: str, price: float | None, html_file: Path | None, as_json: bool
) -> str:
    record = await s.record("jobs", job_id, JobRecord)
    if record is None:
        raise CtlError(f"no job {job_id!r}", code=2)
    events = await _events(s, record)
    result = build(record, events, await _steps(s, job_id))
    if html_file is not None:
        try:
            await asyncio.to_thread(html_file.write_text, html(result, price))
        except OSError as exc:
            raise CtlError(f"--html {html_file}: {exc.strerror}", code=2) from None
    return json.dumps(as_dict(result, price), indent=2) if as_json else text(result, price)


async def _replay(
    s: Session, stream: str, subject: str, start: float | None
) -> list[tuple[datetime, bytes]]:
    """(metadata time, data) of every retained message on ``subject`` from ``start``."""
    try:
        info = await s.js.stream_info(stream)
    except NotFoundError:
        return []
    if info.state.messages == 0:
        return []
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    if start is not None:
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=datetime.fromtimestamp(start, UTC),
        )
    sub = await s.js.subscribe(subject, stream=stream, ordered_consumer=True, config=config)
    out: list[tuple[datetime, bytes]] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=REPLAY_WAIT_S)
            except TimeoutError:
                return out
            out.append((msg.metadata.timestamp, msg.data))
            if msg.metadata.num_pending == 0:
                return out
    finally:
        await sub.unsubscribe()


async def _events(s: Session, record: JobRecord) -> list[EventBase]:
    """The job's own events and, within its span, those of every node it ran on."""
    start = record.submitted_at - SLACK_S if record.submitted_at else None
    raw = await _replay(
        s, subjects.events_stream(s.cluster), subjects.events_filter(s.cluster), start
    )
    events = []
    for _, data in raw:
        try:
            events.append(decode_event(data))
        except msgspec.DecodeError:
            continue
    nodes = {*record.nodes, *record.excluded}
    for e in events:
        if e.job == record.id and isinstance(e, JobStarted | JobRestarted):
            nodes.update(e.nodes)
    end = (record.finished_at or float("inf")) + SLACK_S
    return [
        e
        for e in events
        if e.job == record.id or (e.job is None and e.node in nodes and e.time.timestamp() <= end)
    ]


async def _steps(s: Session, job_id: str) -> list[tuple[float, int]]:
    stream, subject = subjects.progress_stream(s.cluster), subjects.progress_of(s.cluster, job_id)
    out = []
    for stamp, data in await _replay(s, stream, subject, None):
        try:
            msg = progress_decoder.decode(data)
        except msgspec.DecodeError:
            continue
        if isinstance(msg, StepDone):
            out.append((msg.time or stamp.timestamp(), msg.step))
    return out


def text(r: Report, price: float | None) -> str:
    priced = "" if price is None else f", priced at {price:g} a GPU-hour"
    if r.reports_steps:
        progress = f"step {r.step}/{r.target_steps}, {r.step_time_s:.3f} s a productive step"
    else:
        progress = "step unknown (its loop reports no steps)"
    lines = [
        f"job {r.job}: {r.state}, {progress}, {r.world_size} GPUs{priced}",
        "",
        f"{'bucket':18} {'GPU-h':>10}" + ("" if price is None else f" {'cost':>10}"),
    ]
    phases = {f"{name} (phase)": gpu_s for name, gpu_s in r.phases.items()}
    rows = {**r.ledger, **phases}
    total = sum(rows.values())
    for bucket, gpu_s in [*rows.items(), ("total", total)]:
        cost = "" if price is None else f" {gpu_s / 3600 * price:10.4f}"
        lines.append(f"{bucket:18} {gpu_s / 3600:10.4f}{cost}")
    if total and r.reports_steps:
        lines.append(f"goodput: {r.ledger['productive'] / total:.1%} of GPU time was productive")
    elif total:
        lines.append(
            "goodput: unknown; the job's loop reports no steps, so its running time "
            f"({r.ledger.get('unknown', 0.0) / total:.1%} of GPU time) cannot be split into "
            "training and redone work (open the rank API to measure it)"
        )
    lines += ["", "faults (cost measured; saved estimated):"]
    if not r.faults:
        lines.append("  none")
    for f in r.faults:
        saved = "n/a" if f.saved_gpu_s is None else _amount(f.saved_gpu_s, price)
        lines += [
            f"  {f.key}: {f.what}",
            f"    reaction {f.reaction}; cost {_amount(f.cost_gpu_s, price)}; "
            f"saved (estimate) {saved}",
        ]
    lines += ["", ESTIMATES]
    return "\n".join(lines)


def _amount(gpu_s: float, price: float | None) -> str:
    out = f"{gpu_s / 3600:.4f} GPU-h"
    return out if price is None else f"{out} ({gpu_s / 3600 * price:.4f})"


def as_dict(r: Report, price: float | None) -> dict[str, object]:
    data = asdict(r)
    data["ledger_gpu_h"] = {b: v / 3600 for b, v in r.ledger.items()}
    if price is not None:
        data["price_per_gpu_hour"] = price
        data["ledger_cost"] = {b: v / 3600 * price for b, v in r.ledger.items()}
    data["estimates"] = ESTIMATES
    return data
