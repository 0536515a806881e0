"""``tail``: live events, with history replayed from the JetStream event stream."""

from __future__ import annotations

import fnmatch
import json
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from rich.console import Console
from rich.markup import escape

from coordinator.ctl.bus import Session
from coordinator.ctl.errors import CtlError
from proto import subjects
from proto.codec import decode_event
from proto.events import EventBase, Severity, kind_of

_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90s``, ``5m``, ``2h``, ``1d``, or combinations like ``1h30m``; a bare number is
    seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise CtlError(f"--since {text!r}: expected a duration like 90s, 5m, 2h or 1h30m", 2)
    return sum(float(n) * _UNITS[u] for n, u in parts)


@dataclass
class Filters:
    node: str | None = None
    job: str | None = None
    kind: str | None = None
    severity: Severity | None = None

    def match(self, event: EventBase) -> bool:
        if self.node and event.node != self.node:
            return False
        if self.job and event.job != self.job:
            return False
        if self.kind and not fnmatch.fnmatchcase(kind_of(event), self.kind):
            return False
        return not (self.severity and _RANK[event.severity] < _RANK[self.severity])


def line(event: EventBase) -> str:
    when = event.time.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3]
    colour = {"warning": "yellow", "critical": "bold red"}.get(event.severity.value, "")
    sev = f"[{colour}]{event.severity.value:8}[/{colour}]" if colour else f"{'info':8}"
    where = event.job or event.node or "-"
    return f"{when} {sev} {escape(kind_of(event)):24} {escape(where):20} {escape(event.message)}"


async def events(
    s: Session, filters: Filters, since: float | None, follow: bool
) -> AsyncIterator[EventBase]:
    """The cluster's events that ``filters`` match, oldest first: from ``since`` seconds
    ago (None: all the stream holds, or only new ones when following); without
    ``follow``, until the stream has no more. A malformed event is named on stderr and
    skipped."""
    stream = subjects.events_stream(s.cluster)
    # A job's events include what its nodes reported, filed under each node: a job filter
    # is the event's own field (Filters.match), not the subject.
    subject = subjects.events_filter(s.cluster)
    if since is not None:
        start = datetime.fromtimestamp(time.time() - since, UTC)
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)
    elif follow:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.NEW)
    else:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    try:
        info = await s.js.stream_info(stream)
    except NotFoundError:
        raise CtlError(f"no event stream for cluster {s.cluster!r} at {s.url}") from None
    sub = await s.js.subscribe(subject, stream=stream, ordered_consumer=True, config=config)
    if not follow and info.state.messages == 0:
        return
    while True:
        try:
            msg = await sub.next_msg(timeout=None if follow else 2.0)
        except TimeoutError:
            return
        try:
            event = decode_event(msg.data)
        except msgspec.DecodeError as exc:
            print(f"tail: skipped a malformed event on {msg.subject}: {exc}", file=sys.stderr)
            event = None
        if event is not None and filters.match(event):
            yield event
        if not follow and msg.metadata.num_pending == 0:
            return


async def tail(
    s: Session, filters: Filters, since: float | None, follow: bool, as_json: bool
) -> int:
    console = Console(highlight=False, soft_wrap=True)
    async for event in events(s, filters, since, follow):
        if as_json:
            sys.stdout.write(json.dumps(msgspec.to_builtins(event)) + "\n")
            sys.stdout.flush()
        else:
            console.print(line(event))
    return 0
