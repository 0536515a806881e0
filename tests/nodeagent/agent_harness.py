"""Running the real agent as a process against a real nats-server, and watching what it
publishes: events (through the JetStream stream the coordinator would create) and
heartbeats."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import StreamConfig

from proto import subjects
from proto.node import Heartbeat
from tests.waits import until_async

REPO = Path(__file__).resolve().parents[2]
Match = Callable[[dict[str, Any]], bool]


def kind(name: str, **fields: Any) -> Match:
    """Matches events of one kind whose fields equal ``fields``."""
    return lambda e: e["kind"] == name and all(e.get(k) == v for k, v in fields.items())


class Tap:
    """Every event and heartbeat of one cluster, in arrival order."""

    def __init__(self, nc: Client, cluster: str) -> None:
        self.nc = nc
        self.cluster = cluster
        self.events: list[dict[str, Any]] = []
        self.beats: list[Heartbeat] = []

    @classmethod
    async def open(cls, url: str, cluster: str) -> Tap:
        nc = await nats.connect(url)
        tap = cls(nc, cluster)
        await nc.jetstream().add_stream(
            StreamConfig(
                name=subjects.events_stream(cluster), subjects=subjects.events_all(cluster)
            )
        )
        for subject in subjects.events_all(cluster):
            await nc.subscribe(subject, cb=tap._on_event)
        await nc.subscribe(subjects.heartbeats(cluster), cb=tap._on_beat)
        await nc.flush()
        return tap

    async def _on_event(self, msg: Msg) -> None:
        self.events.append(json.loads(msg.data))

    async def _on_beat(self, msg: Msg) -> None:
        self.beats.append(msgspec.json.decode(msg.data, type=Heartbeat))

    async def wait(self, *matches: Match, since: int = 0, timeout: float = 15.0) -> None:
        """Until every match has an event from index ``since`` on."""

        def missing() -> list[int]:
            return [i for i, m in enumerate(matches) if not any(map(m, self.events[since:]))]

        await until_async(
            lambda: not missing(),
            timeout,
            "an event for every match",
            lambda: f"none for matches {missing()}; got {self.events[since:]}",
        )

    async def beat(self, check: Callable[[Heartbeat], bool], timeout: float = 10.0) -> Heartbeat:
        """The first heartbeat from now on that passes ``check``."""
        seen = len(self.beats)
        return await until_async(
            lambda: next((b for b in self.beats[seen:] if check(b)), None),
            timeout,
            "a matching heartbeat",
            lambda: self.beats[-1:],
        )

    async def beats_after(self, count: int, timeout: float = 30.0) -> None:
        """Until ``count`` more heartbeats came: that much of the agent's own time passed."""
        seen = len(self.beats)
        await until_async(
            lambda: len(self.beats) >= seen + count,
            timeout,
            f"{count} more heartbeats",
            lambda: len(self.beats) - seen,
        )

    def count(self, match: Match, since: int = 0) -> int:
        return sum(1 for e in self.events[since:] if match(e))

    async def close(self) -> None:
        await self.nc.close()


@contextmanager
def agent(
    config: Path,
    *,
    node: str,
    cluster: str,
    nats_url: str,
    run_dir: Path,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    metrics_port: int = 0,
) -> Iterator[subprocess.Popen[bytes]]:
    """``nodeagent`` with this config; its log goes to ``run_dir/agent.log``.
    ``metrics_port``: 0, no ``/metrics`` (the default port would clash with another
    test's)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "nodeagent.cli", "--config", str(config), "--node", node]
    argv += ["--cluster", cluster, "--nats", nats_url, "--run-dir", str(run_dir)]
    argv += ["--advertise-addr", "127.0.0.1", "--log-json"]
    argv += ["--warm-ranks", "0", *(extra or [])]  # no ranks here: no spare interpreters
    argv += ["--metrics-port", str(metrics_port)]
    with (run_dir / "agent.log").open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})}
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def health_gate(config: Path, node: str, metrics_port: int) -> subprocess.CompletedProcess[str]:
    """``nodeagent --health-gate`` as Slurm's Prolog would run it on the node."""
    argv = [sys.executable, "-m", "nodeagent.cli", "--config", str(config), "--node", node]
    argv += ["--metrics-port", str(metrics_port), "--health-gate"]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class NotifySocket:
    """A ``$NOTIFY_SOCKET`` as systemd holds it: read as messages arrive (a datagram
    socket's queue holds only a few)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            with suppress(TimeoutError):
                self.messages.append(self.sock.recv(4096).decode())

    async def said(self, ending: str, timeout: float = 10.0) -> None:
        """Until the agent has sent a message ending with ``ending`` (its watchdog pings
        carry the status it had at the time)."""

        def sent() -> bool:
            return any(m.endswith(ending) for m in list(self.messages))

        await until_async(sent, timeout, f"a notify message ending {ending!r}", self.messages.copy)

    def close(self) -> list[str]:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        return self.messages
