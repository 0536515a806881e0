"""Fixtures shared by every suite: a real nats-server with JetStream per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.embedded_nats import NatsServer, start_nats_server


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = start_nats_server(tmp_path / "nats")
    try:
        yield server
    finally:
        server.stop()


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
