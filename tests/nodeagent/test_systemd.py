"""systemd integration: the notify protocol over real datagram sockets (path and abstract),
the watchdog's pace, and ``systemd-analyze verify`` on the units (any output fails)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ringmaster.procs import wait_until_async
from ringmaster.systemd_notify import notify, service, watchdog_interval

REPO = Path(__file__).resolve().parents[2]
UNITS = sorted((REPO / "systemd").glob("*.service"))


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A socket like systemd's: ``$NOTIFY_SOCKET`` is a path, or ``@name`` for an abstract one."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify")
        sock.bind(name)
    else:
        name = f"@ringmaster-test-{os.getpid()}-{uuid.uuid4().hex}"
        sock.bind("\0" + name[1:])
    sock.settimeout(2)
    try:
        yield name, sock
    finally:
        sock.close()


def received(sock: socket.socket) -> list[str]:
    messages = []
    sock.setblocking(False)
    try:
        while True:
            messages.append(sock.recv(4096).decode())
    except BlockingIOError:
        return messages


def test_notify_reaches_the_socket(listener: tuple[str, socket.socket]) -> None:
    name, sock = listener
    assert notify("READY=1\nSTATUS=up", {"NOTIFY_SOCKET": name})
    assert sock.recv(4096) == b"READY=1\nSTATUS=up"


def test_a_reader_that_falls_behind_never_blocks(listener: tuple[str, socket.socket]) -> None:
    """A datagram socket queues a handful of messages; past that a send would block the
    daemon's event loop (and with it the watchdog): it is dropped instead."""
    name, _ = listener
    sent: list[bool] = []
    sender = threading.Thread(
        target=lambda: sent.extend(
            notify("WATCHDOG=1", {"NOTIFY_SOCKET": name}) for _ in range(1000)
        ),
        daemon=True,
    )
    sender.start()
    sender.join(timeout=2.0)
    assert not sender.is_alive(), f"a send blocked on the full queue after {len(sent)} sent"
    assert sent[0] and not sent[-1]


def test_outside_systemd_nothing_happens(tmp_path: Path) -> None:
    assert not notify("READY=1", {})
    assert not notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})


def test_watchdog_interval_is_half_and_only_for_us() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    mine = {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(mine) == 0.5
    assert watchdog_interval(mine | {"WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({}) is None


def test_service_lifecycle(listener: tuple[str, socket.socket]) -> None:
    name, sock = listener
    env = {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "200000"}

    messages: list[str] = []
    naps: list[float] = []

    async def nap(seconds: float) -> None:
        """The pinger's wait: noted, and after the third ping it waits for good."""
        naps.append(seconds)
        if len(naps) == 3:
            await asyncio.Event().wait()

    async def three_pings() -> bool:
        messages.extend(received(sock))
        return sum(m.startswith("WATCHDOG=1") for m in messages) >= 3

    async def run() -> None:
        async with service("node-0 up", lambda: "4/4 collectors ok", env, sleep=nap):
            await wait_until_async(three_pings, timeout=30, interval=0.01)

    asyncio.run(run())
    messages += received(sock)
    assert messages[0] == "READY=1\nSTATUS=node-0 up"
    pings = [m for m in messages if m.startswith("WATCHDOG=1")]
    assert pings == ["WATCHDOG=1\nSTATUS=4/4 collectors ok"] * 3
    # at 0, 0.1, 0.2 s: half of WATCHDOG_USEC between two pings
    assert naps == [0.1, 0.1, 0.1], messages
    assert messages[-1] == "STOPPING=1\nSTATUS=stopping"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_units_verify_without_a_single_warning(tmp_path: Path) -> None:
    """``systemd-analyze verify`` exits 0 on unknown keys and bad values and only prints
    them, so any output fails. It also checks that ExecStart's program exists: the copies
    point it at this checkout's virtualenv instead of the install prefix."""
    assert [u.name for u in UNITS] == [
        "ringmaster-coordinator.service",
        "ringmaster-nodeagent.service",
    ]
    for unit in UNITS:
        text = unit.read_text()
        assert "/opt/ringmaster/bin/" in text
        (tmp_path / unit.name).write_text(
            text.replace("/opt/ringmaster/bin/", f"{REPO}/.venv/bin/")
        )
    result = subprocess.run(
        ["systemd-analyze", "verify", *(str(tmp_path / u.name) for u in UNITS)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_agent_unit_keeps_ranks_alive_and_pings() -> None:
    agent = (REPO / "systemd" / "ringmaster-nodeagent.service").read_text()
    for line in ("Type=notify", "KillMode=process", "WatchdogSec=30", "Restart=always"):
        assert f"\n{line}\n" in agent
    assert "PrivateDevices" not in agent and "ProtectClock" not in agent
