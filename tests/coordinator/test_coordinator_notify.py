"""The coordinator under systemd (Type=notify, WatchdogSec=): READY=1 once it runs, then
watchdog pings whose STATUS= tells its role, then STOPPING=1 on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.embedded_nats import NatsServer
from ringmaster.procs import wait_until

pytestmark = pytest.mark.slow


def test_ready_watchdog_and_stopping(nats_server: NatsServer, tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    env = {**os.environ, "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "--nats", nats_server.url, "--id", "c9"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        messages = [sock.recv(4096).decode()]
        assert messages[0].startswith("READY=1")

        def leads() -> bool:
            """Whether a status line said it leads; else one more message is read."""
            if any("STATUS=leader" in m for m in messages):
                return True
            messages.append(sock.recv(4096).decode())
            return False

        try:
            wait_until(leads, 20.0, interval=0.0)
        except TimeoutError:
            raise AssertionError(messages) from None
        assert any(m.startswith("WATCHDOG=1") for m in messages)
        proc.send_signal(signal.SIGTERM)
        while not messages[-1].startswith("STOPPING=1"):
            messages.append(sock.recv(4096).decode())
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
