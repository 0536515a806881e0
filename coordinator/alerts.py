"""What to tell a chat channel, decided without I/O (the sender is :mod:`.alert_sender`).

The on-call engineer wants one message per problem, not one per event: a condition is
announced when it opens at critical severity and once more when it closes, whatever it
does in between (dedupe by ``Condition.key``); a critical event without a condition is
announced once per kind and place within ``repeat_s``; every job end is announced. Node
problems wait ``summary_window_s`` before they go out, so that a rack losing power reads
as one "N nodes: …" message instead of fifty. Time is passed in (``now``, monotonic), so
all of it is tested without clocks or sockets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from proto.events import EventBase, JobCompleted, JobFailed, JobStopped, Severity, kind_of
from proto.job import JobRecord

SEEN_EVENTS = 4096  # fingerprints kept to make "once per event" hold across both hooks


@dataclass(frozen=True)
class AlertSettings:
    summary_window_s: float = 2.0  # node alerts are held this long to be summarised
    summary_over: int = 5  # more node alerts than this to one URL in a window: a summary
    repeat_s: float = 300.0  # a condition-less critical event repeated within this: dropped
    rate_per_s: float = 1.0  # token bucket per URL (Slack accepts about one a second)
    burst: int = 5


@dataclass(frozen=True)
class Alert:
    url: str
    text: str
    node: str | None = None  # set for node alerts, which a summary may group
    what: str = ""  # "critical gpu.thermal", "resolved nvme.latency": a summary's counts


@dataclass
class _Open:
    urls: frozenset[str]
    since: float


@dataclass
class AlertPolicy:
    settings: AlertSettings = field(default_factory=AlertSettings)
    _open: dict[str, _Open] = field(default_factory=dict)
    _recent: dict[str, float] = field(default_factory=dict)
    _seen: OrderedDict[tuple[str, ...], None] = field(default_factory=OrderedDict)
    _held: list[Alert] = field(default_factory=list)
    _window_ends: float | None = None

    def offer(self, event: EventBase, urls: frozenset[str], now: float) -> list[Alert]:
        """Alerts to send now for one event; node alerts are held for :meth:`due`."""
        if self._already_seen(event):
            return []
        told = self._tell(event, urls, now)
        if told is None or not told[2]:
            return []
        text, what, to = told
        if event.job is not None or event.node is None:
            return [Alert(url, text) for url in sorted(to)]
        if self._window_ends is None:
            self._window_ends = now + self.settings.summary_window_s
        self._held += [Alert(url, text, event.node, what) for url in sorted(to)]
        return []

    def due(self, now: float) -> list[Alert]:
        """Held node alerts once their window has ended: each URL gets them one by one, or
        one summary when there are more than ``summary_over``."""
        if self._window_ends is None or now < self._window_ends:
            return []
        held, self._held, self._window_ends = self._held, [], None
        self._recent = {k: t for k, t in self._recent.items() if now - t < self.settings.repeat_s}
        by_url: dict[str, list[Alert]] = {}
        for alert in held:
            by_url.setdefault(alert.url, []).append(alert)
        out: list[Alert] = []
        for url, alerts in by_url.items():
            if len(alerts) > self.settings.summary_over:
                out.append(Alert(url, summary(alerts)))
            else:
                out += alerts
        return out

    def _already_seen(self, event: EventBase) -> bool:
        """The leader's own events reach it twice (published, then consumed from the
        stream), and JetStream redelivers what was not acked: the first copy counts."""
        mark = (kind_of(event), event.time.isoformat(), event.node or "", event.job or "")
        if mark in self._seen:
            return True
        self._seen[mark] = None
        if len(self._seen) > SEEN_EVENTS:
            self._seen.popitem(last=False)
        return False

    def _tell(
        self, event: EventBase, urls: frozenset[str], now: float
    ) -> tuple[str, str, frozenset[str]] | None:
        """(text, what, to whom), or None when the event is no news."""
        cond, kind = event.condition, kind_of(event)
        where = f"job {event.job}" if event.job else f"{event.node or 'cluster'}"
        if isinstance(event, JobCompleted | JobFailed | JobStopped):
            word = kind.split(".")[1]
            return f"[{word.upper()}] job {event.job}: {event.message}", f"job {word}", urls
        if cond is not None and not cond.active:
            opened = self._open.pop(cond.key, None)
            if opened is None:
                return None
            took = _duration(now - opened.since)
            text = f"[RESOLVED] {cond.key} after {took}: {event.message or cond.reason}"
            return text, f"resolved {cond.kind.value}", opened.urls
        if event.severity is not Severity.CRITICAL:
            return None
        if cond is not None:
            if cond.key in self._open or not urls:
                return None
            self._open[cond.key] = _Open(urls, now)
            text = f"[CRITICAL] {cond.key} on {where}: {event.message or cond.reason}"
            return text, f"critical {cond.kind.value}", urls
        repeat = f"{kind}:{event.job or event.node or '-'}"  # a job's ranks: one message
        if now - self._recent.get(repeat, -self.settings.repeat_s) < self.settings.repeat_s:
            return None
        self._recent[repeat] = now
        return f"[CRITICAL] {kind} on {where}: {event.message}", f"critical {kind}", urls


def summary(alerts: list[Alert], named: int = 10) -> str:
    """``N nodes: …`` naming the first few nodes and what happened, most common first."""
    nodes = sorted({a.node or "-" for a in alerts})
    what: dict[str, int] = {}
    for alert in alerts:
        what[alert.what] = what.get(alert.what, 0) + 1
    counts = ", ".join(f"{label} ×{n}" for label, n in sorted(what.items(), key=lambda i: -i[1]))
    shown = ", ".join(nodes[:named]) + (
        f" (+{len(nodes) - named} more)" if len(nodes) > named else ""
    )
    return f"{len(nodes)} nodes: {counts} — {shown}"


def destinations(event: EventBase, jobs: Iterable[JobRecord], default: str) -> frozenset[str]:
    """Where an event is told: the coordinator's URL, plus the webhook of the job it
    concerns or of every live job on the node it concerns."""
    urls = {default} if default else set()
    for job in jobs:
        url = job.spec.alerts.webhook_url
        if url and (event.job == job.id or (event.node in job.nodes and not job.state.terminal)):
            urls.add(url)
    return frozenset(urls)


def payload(text: str) -> dict[str, Any]:
    """Slack's incoming-webhook shape; ``text`` alone reads right where blocks are not
    rendered (notifications, other chat tools' Slack-compatible endpoints)."""
    return {"text": text, "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]}


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; :meth:`take` says how long to wait."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.at = float(burst), now

    def take(self, now: float) -> float:
        """Take a token and return 0, or return the seconds until one is there."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
