"""``up`` and ``down``: a whole cluster on one machine — an embedded NATS server with
JetStream, one hardware simulator for all nodes, one real agent per node pointed at its
simulated tree, and one or two coordinators. Every process is detached (its own session),
with its PID in ``DIR/pids`` and its log in ``DIR/logs``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
from nats.js.errors import NoKeysError

from coordinator.ctl.errors import CtlError
from coordinator.ctl.home import (
    LocalCluster,
    agent_process,
    agent_run_dir,
    agent_run_dirs,
    nodes_root,
    pid_file,
    pids_dir,
    running,
)
from coordinator.embedded_nats import NatsServerMissing, start_nats_server
from coordinator.kvstore import ensure_layout
from proto.node import NodeRecord, NodeState
from ringmaster.bus import connect
from ringmaster.metrics import ANY_PORT
from ringmaster.procs import pid_alive, read_pid, wait_until, wait_until_async
from ringmaster.rundir import live_ranks

# Every daemon of a local cluster serves /metrics on a port the kernel picks (many share one
# host), on loopback only; `status --json` names each one's URL.
METRICS_FLAGS = [f"--metrics-port={ANY_PORT}", "--metrics-addr=127.0.0.1"]


def up(
    directory: Path, nodes: int, gpus: int, standby: bool, cluster: str, timeout: float = 90.0
) -> LocalCluster:
    if nodes < 1 or gpus < 1:
        raise CtlError("--nodes and --gpus-per-node must be at least 1", code=2)
    if (existing := running(directory)) is not None:
        print(f"ringmaster: local cluster already running in {directory}", file=sys.stderr)
        return existing
    logs, root = directory / "logs", nodes_root(directory)
    for d in (pids_dir(directory), logs, root):
        d.mkdir(parents=True, exist_ok=True)
    try:
        server = start_nats_server(directory / "nats", detach=True)
    except (NatsServerMissing, RuntimeError) as exc:
        raise CtlError(str(exc)) from None
    pid_file(directory, "nats-server").write_text(str(server.pid))
    names = [f"node-{i}" for i in range(nodes)]
    coordinators = ["coordinator-0", "coordinator-1"] if standby else ["coordinator-0"]
    local = LocalCluster(
        nats=server.url, cluster=cluster, nodes=names, gpus_per_node=gpus, coordinators=coordinators
    )
    (directory / "cluster.json").write_bytes(msgspec.json.encode(local))
    py = sys.executable
    sim = [py, "-m", "nodeagent.sim", "--root", str(root), "--nodes", ",".join(names)]
    sim += ["--nats", server.url, "--cluster", cluster, "--gpus", str(gpus)]
    _spawn("simulator", sim, directory)
    try:
        wait_until(lambda: all((root / n / ".ready").exists() for n in names), 60)
    except TimeoutError:
        raise CtlError("the simulator did not come up within 60 s") from None
    for name in names:
        # agent.toml (written by the simulator) points the real agent at this node's
        # simulated trees, stub NVML library, metadata service and clock skew.
        _spawn(
            agent_process(name),
            [
                py,
                "-m",
                "nodeagent.cli",
                "--config",
                str(root / name / "agent.toml"),
                "--node",
                name,
                "--cluster",
                cluster,
                "--nats",
                server.url,
                "--run-dir",
                str(agent_run_dir(directory, name)),
                "--gpus",
                str(gpus),
                "--advertise-addr",
                "127.0.0.1",
                *METRICS_FLAGS,
            ],
            directory,
        )
    for coordinator in coordinators:
        _spawn(
            coordinator,
            [
                py,
                "-m",
                "coordinator.cli",
                "--id",
                coordinator,
                "--cluster",
                cluster,
                "--nats",
                server.url,
                *METRICS_FLAGS,
            ],
            directory,
        )
    seen: dict[str, NodeRecord] = {}
    try:
        asyncio.run(_await_nodes(local, seen, timeout))
    except TimeoutError:
        missing = ", ".join(n for n in names if n not in seen)
        raise CtlError(
            f"nodes did not all register within {timeout:.0f} s (missing: {missing}); see {logs}"
        ) from None
    for record in seen.values():
        if record.state is not NodeState.READY:
            # registered but not admissible: the operator should know before starting a job
            why = "; ".join(c.reason or c.key for c in record.conditions) or "no reason given"
            print(f"ringmaster: {record.id} is {record.state.value}: {why}", file=sys.stderr)
    return local


def _spawn(name: str, argv: list[str], directory: Path) -> None:
    with (directory / "logs" / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    pid_file(directory, name).write_text(str(proc.pid))


async def _await_nodes(local: LocalCluster, seen: dict[str, NodeRecord], timeout: float) -> None:
    """Wait until the coordinator has a live record of every node, whatever its health: a
    node whose preflight fails is registered (and degraded), not missing. ``seen`` fills
    as records appear, so a timeout can name the nodes still missing."""
    nc = await connect(local.nats, "coordinatorctl-up")
    try:
        buckets = await ensure_layout(nc.jetstream(), local.cluster)

        async def all_seen() -> bool:
            with contextlib.suppress(NoKeysError):
                for key in await buckets.nodes.keys():
                    entry = await buckets.nodes.get(key)
                    if entry.value:
                        record = msgspec.json.decode(entry.value, type=NodeRecord)
                        if record.state is not NodeState.LOST:
                            seen[record.id] = record
            return set(seen) >= set(local.nodes)

        await wait_until_async(all_seen, timeout, interval=0.2)
    finally:
        await nc.close()


# Stop order: what produces work first, the bus last.
def _order(name: str) -> int:
    if name.startswith("coordinator"):
        return 0
    if name.startswith("nodeagent"):
        return 1
    if name == "simulator":
        return 2
    return 3


def down(directory: Path, timeout: float = 15.0) -> list[str]:
    """Stop every rank, daemon and server ``up`` started. Returns what was stopped."""
    stopped: list[str] = []
    # Training ranks outlive agent restarts by design, so they are stopped explicitly.
    for run_dir in agent_run_dirs(directory):
        for rank in live_ranks(run_dir):
            _kill_group(rank.pid, timeout)
            stopped.append(f"rank {rank.job}/rank-{rank.rank} ({rank.pid})")
    for pidfile in sorted(pids_dir(directory).glob("*.pid"), key=lambda p: _order(p.stem)):
        pid = read_pid(pidfile)
        if pid is not None and pid_alive(pid):
            _kill_group(pid, timeout)
            stopped.append(f"{pidfile.stem} ({pid})")
        pidfile.unlink(missing_ok=True)
    (directory / "cluster.json").unlink(missing_ok=True)
    return stopped


def _kill_group(pid: int, timeout: float) -> None:
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not pid_alive(pid), wait)
            return
