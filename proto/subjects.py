"""Subject, stream and bucket names. ``ringmaster.<cluster>.<node|job>.<id>.<kind>`` for
events so that a plain NATS client can subscribe with ordinary wildcards."""

from __future__ import annotations

import re

ROOT = "ringmaster"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def check_token(value: str, what: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must be letters, digits, '-' or '_'")
    return value


def event(cluster: str, scope: str, ident: str, kind: str) -> str:
    return f"{ROOT}.{cluster}.{scope}.{ident}.{kind}"


def events_filter(
    cluster: str, *, node: str | None = None, job: str | None = None, kind: str | None = None
) -> str:
    """A subject filter for the event stream; node and job filters are exclusive scopes."""
    scope, ident = ("*", "*")
    if job:
        scope, ident = "job", job
    elif node:
        scope, ident = "node", node
    return f"{ROOT}.{cluster}.{scope}.{ident}.{kind if kind else '>'}"


def events_all(cluster: str) -> list[str]:
    return [f"{ROOT}.{cluster}.{s}.>" for s in ("node", "job", "cluster")]


def heartbeat(cluster: str, node: str) -> str:
    return f"{ROOT}.{cluster}.hb.{node}"


def heartbeats(cluster: str) -> str:
    return f"{ROOT}.{cluster}.hb.*"


def canary(cluster: str, coordinator: str) -> str:
    """A coordinator's message to itself through the server: while it does not come
    back, the bus is out, and silent nodes are not lost nodes."""
    return f"{ROOT}.{cluster}.canary.{coordinator}"


def coordinator_alive(cluster: str, coordinator: str) -> str:
    """Answered by every live coordinator process: a request that finds no responder means
    the server holds no connection of that coordinator any more (its process died), which
    a standby takes the lease on without waiting out the TTL."""
    return f"{ROOT}.{cluster}.alive.{coordinator}"


def command(cluster: str, node: str) -> str:
    return f"{ROOT}.{cluster}.cmd.{node}"


def api(cluster: str, verb: str) -> str:
    return f"{ROOT}.{cluster}.api.{verb}"


def progress(cluster: str, job: str, node: str) -> str:
    """Trainer progress relayed by the agent of ``node``, the node hosting rank 0: the
    subject names the sender, so the bus confines an agent to its own node's word."""
    return f"{ROOT}.{cluster}.progress.{job}.{node}"


def progress_of(cluster: str, job: str) -> str:
    """Every node's progress subject for ``job`` (a filter)."""
    return f"{ROOT}.{cluster}.progress.{job}.*"


def progress_all(cluster: str) -> str:
    return f"{ROOT}.{cluster}.progress.*.*"


def sender(subject: str) -> str | None:
    """The node a subject names as its sender: the last token of a progress subject, the
    id of a ``node``-scoped event's or of a heartbeat's; None for every other subject
    (the coordinators' own job and cluster events)."""
    parts = subject.split(".")
    if len(parts) < 4 or parts[0] != ROOT:
        return None
    match parts[2]:
        case "progress" if len(parts) == 5:
            return parts[4]
        case "node" | "hb":
            return parts[3]
    return None


def clock(cluster: str) -> str:
    """NTP-style clock probes from agents; any coordinator answers (queue group)."""
    return f"{ROOT}.{cluster}.clock"


def sim(cluster: str, node: str) -> str:
    """Fault injection on a simulated node; real nodes have no responder here."""
    return f"{ROOT}.{cluster}.sim.{node}"


def events_stream(cluster: str) -> str:
    return f"RINGMASTER_{cluster.upper().replace('-', '_')}_EVENTS"


def bucket(cluster: str, what: str) -> str:
    return f"ringmaster_{cluster}_{what}".replace("-", "_")


def progress_stream(cluster: str) -> str:
    return f"RINGMASTER_{cluster.upper().replace('-', '_')}_PROGRESS"
