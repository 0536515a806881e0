"""Fixtures shared by every suite: a real nats-server with JetStream per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.embedded_nats import NatsServer, start_nats_server
from tests.schedule import cost, deal
from tests.trainer.zygote import Zygote


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The scenarios dealt to the workers so that they end together (tests/schedule.py)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    slow = [item.get_closest_marker("slow") is not None for item in items]
    items[:] = deal(items, [cost(item) for item in items], slow, workers)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = start_nats_server(tmp_path / "nats")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs as if outside systemd, whatever runs the suite: an agent a test starts
    on this machine's /proc never retunes its kernel (``nodeagent.collectors.sysctl`` does
    only under systemd); a test that wants systemd's environment sets it itself."""
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``pytest.mark.anyio``) run on asyncio, like the daemons."""
    return "asyncio"


LOOPBACK_METADATA = "http://127.0.0.1:9"  # closed: probes are refused at once


@pytest.fixture
def host_agent_config(tmp_path: Path) -> Path:
    """Settings for a real agent on this test machine. Cloud metadata probes go to a closed
    loopback port, never to 169.254.169.254 or a cloud's DNS name (tests send traffic to
    this machine only); this host's unsynchronised kernel clock does not count."""
    path = tmp_path / "host-agent.toml"
    path.write_text(
        "[preemption]\n"
        f'aws_url = "{LOOPBACK_METADATA}"\n'
        f'gcp_url = "{LOOPBACK_METADATA}"\n'
        f'azure_url = "{LOOPBACK_METADATA}"\n'
        "[clock]\n"
        "adjtimex = false\n"
        "chronyc = []\n"
    )
    return path


@pytest.fixture(scope="session")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote | None]:
    """This test worker's fork server for ranks and scripts (tests/trainer/zygote.py),
    started on first use; ``RINGMASTER_TEST_FORK=0``: none, every rank starts cold as the
    node agent starts one."""
    if os.environ.get("RINGMASTER_TEST_FORK") == "0":
        yield None
        return
    server = Zygote(tmp_path_factory.mktemp("zygote"))
    yield server
    server.close()
