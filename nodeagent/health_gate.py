"""``nodeagent --health-gate``: may this node take work now?

For a scheduler's own node check — Slurm's ``Prolog`` (a non-zero exit drains the node and
requeues the job) or a ``HealthCheckProgram`` wrapper — it asks the local agent for the
node's open conditions through the agent's ``/metrics`` (the ``ringmaster_node_condition``
series, one per open condition) and decides:

- exit 1 with one line naming them when any condition counts against the node (severity
  ``warning`` or ``critical``; an advisory ``info`` one, a stock kernel setting, does not);
- exit 0 when none does;
- exit 0 with a warning on stderr when the agent cannot be asked (stopped, restarting, its
  metrics off): a stopped agent must never drain a whole cluster.

The decision (:func:`verdict`) is pure; reading the endpoint is the thin shell around it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ringmaster import rundir
from ringmaster.metrics import ANY_PORT

CONDITION_METRIC = "ringmaster_node_condition"
REFUSED = 1  # the node must not take work
TIMEOUT_S = 3.0  # a health check runs on every node, often: it must not hang


@dataclass(frozen=True)
class Open:
    """An open condition the agent reports."""

    kind: str
    subject: str
    severity: str

    def __str__(self) -> str:
        where = f" {self.subject}" if self.subject else ""
        return f"{self.kind}{where} ({self.severity})"


def open_conditions(exposition: str) -> list[Open]:
    """The open conditions in an agent's ``/metrics`` text."""
    found = []
    for family in text_string_to_metric_families(exposition):
        if family.name != CONDITION_METRIC:
            continue
        for sample in family.samples:
            if sample.value == 1:
                labels = sample.labels
                found.append(Open(labels["kind"], labels.get("subject", ""), labels["severity"]))
    return found


def verdict(node: str, conditions: list[Open]) -> tuple[int, str]:
    """The exit status and the line to print for ``conditions`` open on ``node``."""
    against = [c for c in conditions if c.severity != "info"]
    if against:
        named = ", ".join(map(str, against))
        return REFUSED, f"ringmaster: {node} must not take work: {named}"
    advisory = f" ({len(conditions)} advisory condition(s) open)" if conditions else ""
    return 0, f"ringmaster: {node} may take work{advisory}"


def check(node: str, url: str | None, timeout_s: float = TIMEOUT_S) -> tuple[int, str]:
    """Ask the agent at ``url`` (None: its metrics are off) and decide; an agent that
    cannot be asked is a warning and exit 0."""
    if url is None:
        return 0, f"warning: ringmaster: cannot ask {node}'s agent: its metrics are off"
    try:
        reply = httpx.get(url, timeout=timeout_s)
        reply.raise_for_status()
        conditions = open_conditions(reply.text)
    except httpx.HTTPError as exc:
        why = str(exc) or type(exc).__name__
        return 0, f"warning: ringmaster: cannot ask {node}'s agent at {url}: {why}"
    except (ValueError, KeyError) as exc:
        return 0, f"warning: ringmaster: {url} answered what is not an agent's metrics: {exc}"
    return verdict(node, conditions)


def metrics_url(addr: str, port: int, run_dir: Path) -> str | None:
    """Where the local agent serves ``/metrics`` (None: off, or on a port chosen at start
    that the agent has not recorded in ``run_dir``, with the address it bound)."""
    if port == ANY_PORT:
        with contextlib.suppress(OSError):
            recorded = rundir.metrics_url(run_dir).read_text().strip()
            return recorded if recorded.startswith("http://") else None
        return None
    if port <= 0:
        return None
    host = "127.0.0.1" if addr in ("", "0.0.0.0") else addr
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/metrics"
