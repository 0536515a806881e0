"""``join NODE``: a real node in a local cluster. Its agent runs on this machine's own
network stack and hardware (``/sys``, ``/proc``, ``/dev``; NVML where there is a GPU),
beside the simulated nodes of ``up``, and hosts ranks like them: on CPU without a GPU.

With auth, the node gets a user of its own (``coordinator.auth.add_agent``), and the
server admits it on a reload (SIGHUP), nobody else disturbed. The agent's settings are
``DIR/nodes/NODE/agent.toml``, written once with what a local cluster needs and the
production defaults for the rest, so an operator's edits survive the next ``join``. The
agent is started like ``up``'s (detached, ``DIR/logs``, ``DIR/pids``), so ``down`` stops
it and its ranks; ``--print`` only prints its command line, to run where one likes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import msgspec

from coordinator.auth import OPERATOR, add_agent, creds_path
from coordinator.ctl import netns as ns
from coordinator.ctl.errors import CtlError
from coordinator.ctl.home import (
    LocalCluster,
    agent_process,
    agent_run_dir,
    nodes_root,
    pid_file,
    running,
)
from coordinator.ctl.local import await_nodes, why
from coordinator.ctl.spawn import spawn
from proto import subjects
from proto.node import NodeRecord, NodeState
from ringmaster.auth import Refused
from ringmaster.bus import connect
from ringmaster.metrics import ANY_PORT
from ringmaster.procs import pid_alive, read_pid
from ringmaster.toml_out import to_toml

FILE = "agent.toml"  # the agent's settings file, beside its run dir (as ``up`` writes it)

# What differs from the production defaults, and why: every daemon of a local cluster
# serves /metrics on a free loopback port; a workstation has no cloud metadata service
# to poll; a rehearsal retunes none of the host's sysctls; and the ranks of a local
# cluster reach each other on loopback (the rendezvous master is at 127.0.0.1), so lo is
# the interface they cross, not the default route's.
SETTINGS = {
    "metrics_port": ANY_PORT,
    "metrics_addr": "127.0.0.1",
    "preemption": {"provider": "none"},
    "preflight": {"fix": False},
    "network": {"data_interface": "lo"},
}


def command(directory: Path, node: str, gpus: int | None) -> tuple[LocalCluster, list[str]]:
    """The running local cluster and the ``nodeagent`` command line of ``node``, its
    settings written and (with auth) its user admitted. ``gpus``: ranks it hosts, by
    default as many as each simulated node."""
    local = _cluster(directory, node)
    argv = [sys.executable, "-m", "nodeagent.cli", "--config", str(_settings(directory, node))]
    argv += ["--node", node, "--cluster", local.cluster, "--nats", local.nats]
    argv += ["--run-dir", str(agent_run_dir(directory, node))]
    argv += ["--gpus", str(gpus or local.gpus_per_node)]
    if local.auth:
        argv += ["--creds", str(_admit(directory, local, node))]
    return local, argv


def join(directory: Path, node: str, gpus: int | None, timeout: float = 60.0) -> str:
    """Start the agent of ``node`` and return once the coordinator has its record: a line
    with its state and open conditions (a stock host has warnings, and is admitted)."""
    local, argv = command(directory, node, gpus)
    pid = spawn(agent_process(node), argv, directory)
    seen: dict[str, NodeRecord] = {}
    operator = str(creds_path(directory, OPERATOR)) if local.auth else None
    try:
        asyncio.run(
            await_nodes(msgspec.structs.replace(local, nodes=[node]), operator, seen, timeout)
        )
    except TimeoutError:
        log = directory / "logs" / f"{agent_process(node)}.log"
        raise CtlError(f"{node} did not register within {timeout:.0f} s; see {log}") from None
    record = seen[node]
    said = f"{node} joined (agent pid {pid}): {record.state.value}"
    if record.conditions or record.state is not NodeState.READY:
        said += f": {why(record)}"
    return said


def _cluster(directory: Path, node: str) -> LocalCluster:
    local = running(directory)
    if local is None:
        raise CtlError(f"no local cluster running in {directory} (start one with up)")
    try:
        subjects.check_token(node, "node id")
    except ValueError as exc:
        raise CtlError(str(exc), code=2) from None
    if node in local.nodes:
        raise CtlError(f"{node} is a simulated node of this cluster", code=2)
    pid = read_pid(pid_file(directory, agent_process(node)))
    if pid is not None and pid_alive(pid):
        raise CtlError(f"the agent of {node} is already running (pid {pid})", code=2)
    return local


def _settings(directory: Path, node: str) -> Path:
    path = nodes_root(directory) / node / FILE
    net = ns.read(directory)
    data_addr = ns.host_on_data(net) if net is not None else ""
    if not path.exists():
        settings: dict[str, Any] = dict(SETTINGS)
        if net is not None:
            # up --netns: this host's own stack is the node, on both bridges; the ranks
            # cross the data bridge, the coordinators scrape over the control one
            settings["metrics_addr"] = net.host_addr
            settings["advertise_addr"] = data_addr
            settings["network"] = {"data_interface": net.data_bridge}
        path.parent.mkdir(parents=True, exist_ok=True)
        head = "# written by `coordinatorctl join` for a real node; join keeps your edits\n"
        path.write_text(head + to_toml(settings))
    return path


def _admit(directory: Path, local: LocalCluster, node: str) -> Path:
    """The node's creds, once the server accepts them: it reloads its users on SIGHUP,
    and an agent refused at its first connection would exit."""
    creds = add_agent(directory, local.cluster, node)
    server = read_pid(pid_file(directory, "nats-server"))
    if server is None:
        raise CtlError(f"no NATS server pid in {directory}")
    os.kill(server, signal.SIGHUP)
    try:
        asyncio.run(asyncio.wait_for(_accepted(local.nats, creds), 10.0))
    except TimeoutError:
        log = directory / "nats" / "nats-server.log"
        raise CtlError(f"NATS did not admit {node}'s new user within 10 s; see {log}") from None
    return creds


async def _accepted(url: str, creds: Path) -> None:
    while True:
        try:
            nc = await connect(url, "coordinatorctl-join", str(creds))
        except Refused:  # not reloaded yet
            await asyncio.sleep(0.2)
            continue
        with contextlib.suppress(Exception):
            await nc.close()
        return
