"""``promtool check metrics`` — Prometheus' own linter — over what each daemon serves on
/metrics: the real exporters, fed records with every kind of series present, scraped over
HTTP as Prometheus would. (tests/e2e/test_prometheus.py does the same on a running
cluster.)"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections.abc import Callable

import pytest
from metric_states import agent_registry, coordinator
from prometheus_client import CollectorRegistry

from coordinator.election import Role
from ringmaster import metrics

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not found: install Debian's prometheus package "
    "(apt-get install prometheus; ./scripts/bootstrap.sh does it when run as root)",
)


def promtool_problems(exposition: str) -> str:
    """What ``promtool check metrics`` says of ``exposition`` ("" when it passes)."""
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    said = (done.stdout + done.stderr).strip()
    return said if said or done.returncode == 0 else f"exit {done.returncode}"


def scraped(registry: CollectorRegistry) -> str:
    """``registry`` as the daemons' endpoint serves it."""
    server = metrics.serve(registry, metrics.ANY_PORT, "127.0.0.1", "x")
    assert server is not None
    try:
        with urllib.request.urlopen(server.url, timeout=5) as reply:
            return str(reply.read().decode())
    finally:
        server.close()


@pytest.mark.parametrize(
    "endpoint",
    [
        lambda: agent_registry(),
        lambda: coordinator(Role.LEADER)[0],
        lambda: coordinator(Role.FOLLOWER)[0],
    ],
    ids=["agent", "leader", "standby"],
)
def test_every_endpoint_passes_promtool(endpoint: Callable[[], CollectorRegistry]) -> None:
    body = scraped(endpoint())
    assert "ringmaster_coordinator_leader" in body or "ringmaster_gpu_info" in body
    assert promtool_problems(body) == ""


def test_promtool_finds_what_it_should() -> None:
    """The check above proves something only if promtool would object to a bad name."""
    said = promtool_problems("# TYPE ringmaster_step_ms gauge\nringmaster_step_ms 1\n")
    assert "abbreviated units" in said and "no help text" in said
