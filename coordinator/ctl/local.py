"""``up`` and ``down``: a whole cluster on one machine — an embedded NATS server with
JetStream, one hardware simulator for all nodes, one real agent per node pointed at its
simulated tree, one warm template the agents fork their spares from (``ctl.warm``), and
one or two coordinators. Every process is detached (its own session), with its PID in
``DIR/pids`` and its log in ``DIR/logs``. With ``auth`` (the default) the
server admits only the users of ``coordinator.auth``: each process gets its own creds file
in ``DIR/secrets``, by path, and the CLI uses ``operator.json``. With ``netns`` each node
is a host of its own on a control and a data network (``coordinator.ctl.netns``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path

import msgspec
from nats.js.errors import BucketNotFoundError, NotFoundError

from coordinator.auth import OPERATOR, SIMULATOR, agent_user, creds_path
from coordinator.auth import init as init_auth
from coordinator.ctl import netns as ns
from coordinator.ctl import warm
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
from coordinator.ctl.spawn import last_line, spawn
from coordinator.embedded_nats import NatsServerMissing, start_nats_server
from coordinator.kvstore import Buckets, bind, decoded
from proto.node import NodeRecord, NodeState
from ringmaster import memory_store
from ringmaster.bus import connect
from ringmaster.metrics import ANY_PORT
from ringmaster.procs import pid_alive, read_pid, wait_until, wait_until_async
from ringmaster.rundir import JobDir, job_ids, live_ranks, live_spares, spare_dir


def metrics_flags(addr: str = "127.0.0.1") -> list[str]:
    """Every daemon of a local cluster serves /metrics on a port the kernel picks (many
    share one host), on loopback, or in a namespace on its control address so the host
    reaches it; `status --json` names each one's URL."""
    return [f"--metrics-port={ANY_PORT}", f"--metrics-addr={addr}"]


def up(
    directory: Path,
    nodes: int,
    gpus: int,
    standby: bool,
    cluster: str,
    timeout: float = 90.0,
    auth: bool = True,
    netns: bool = False,
    ctl_net: str = ns.CTL_NET,
    data_net: str = ns.DATA_NET,
) -> LocalCluster:
    if nodes < 1 or gpus < 1:
        raise CtlError("--nodes and --gpus-per-node must be at least 1", code=2)
    if (existing := running(directory)) is not None:
        print(f"ringmaster: local cluster already running in {directory}", file=sys.stderr)
        return existing
    logs, root = directory / "logs", nodes_root(directory)
    for d in (pids_dir(directory), logs, root):
        d.mkdir(parents=True, exist_ok=True)
    names = [f"node-{i}" for i in range(nodes)]
    coordinators = ["coordinator-0", "coordinator-1"] if standby else ["coordinator-0"]
    # fresh passwords on every start; without auth, no stale creds for the CLI to pick up
    shutil.rmtree(directory / "secrets", ignore_errors=True)
    config = init_auth(directory, cluster, names, coordinators) if auth else None

    def creds(principal: str) -> list[str]:
        return ["--creds", str(creds_path(directory, principal))] if auth else []

    net = ns.plan(directory, names, ctl_net, data_net) if netns else None
    if net is not None:
        ns.create(directory, net)
    else:  # a namespaced cluster's record, left by a crash: not this cluster's
        ns.record_file(directory).unlink(missing_ok=True)
    try:
        server = start_nats_server(
            directory / "nats",
            detach=True,
            config=config,
            host=net.host_addr if net else "127.0.0.1",
        )
    except (NatsServerMissing, RuntimeError) as exc:
        raise CtlError(str(exc)) from None
    pid_file(directory, "nats-server").write_text(str(server.pid))
    local = LocalCluster(
        nats=server.url,
        cluster=cluster,
        nodes=names,
        gpus_per_node=gpus,
        coordinators=coordinators,
        auth=auth,
    )
    (directory / "cluster.json").write_bytes(msgspec.json.encode(local))
    py = sys.executable
    template = warm.start(directory) if warm.wanted(os.environ) else None  # imports meanwhile
    sim = [py, "-m", "nodeagent.sim", "--root", str(root), "--nodes", ",".join(names)]
    sim += ["--nats", server.url, "--cluster", cluster, "--gpus", str(gpus), *creds(SIMULATOR)]
    sim += ["--netns-host", net.host_addr] if net else []
    sim += ["--warm-template-socket", str(template)] if template else []
    spawn("simulator", sim, directory)
    try:
        wait_until(lambda: all((root / n / ".ready").exists() for n in names), 60)
    except TimeoutError:
        raise CtlError("the simulator did not come up within 60 s") from None
    for name in names:
        # agent.toml (written by the simulator) points the real agent at this node's
        # simulated trees, stub NVML library, metadata service and clock skew. In a
        # namespace it advertises its data address: the rendezvous master listens there.
        host = net.nodes[name] if net else None
        spawn(
            agent_process(name),
            [
                *ns.wrapper(net, name),
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
                host.data_addr if host else "127.0.0.1",
                *creds(agent_user(name)),
                *metrics_flags(host.ctl_addr if host else "127.0.0.1"),
            ],
            directory,
        )
    for coordinator in coordinators:
        spawn(
            coordinator,
            [
                *ns.wrapper(net, "coordinators"),
                py,
                "-m",
                "coordinator.cli",
                "--id",
                coordinator,
                "--cluster",
                cluster,
                "--nats",
                server.url,
                *creds(coordinator),
                *metrics_flags(net.coordinators.ctl_addr if net else "127.0.0.1"),
            ],
            directory,
        )
    seen: dict[str, NodeRecord] = {}
    try:
        operator = str(creds_path(directory, OPERATOR)) if auth else None
        asyncio.run(await_nodes(local, operator, seen, timeout))
    except TimeoutError:
        absent = [n for n in names if n not in seen]
        said = last_line(logs / f"{agent_process(absent[0])}.log")
        raise CtlError(
            f"nodes did not all register within {timeout:.0f} s (missing: {', '.join(absent)}); "
            f"{absent[0]}'s agent last said: {said}; see {logs}"
        ) from None
    for record in seen.values():
        if record.state is not NodeState.READY:
            # registered but not admissible: the operator should know before starting a job
            print(
                f"ringmaster: {record.id} is {record.state.value}: {why(record)}", file=sys.stderr
            )
    if template is not None:
        warm.await_ready(template, logs)  # else the first ranks start cold
    return local


def why(record: NodeRecord) -> str:
    """A node's open conditions in one line, for the operator."""
    return "; ".join(c.reason or c.key for c in record.conditions) or "no reason given"


async def await_nodes(
    local: LocalCluster, creds: str | None, seen: dict[str, NodeRecord], timeout: float
) -> None:
    """Wait until the coordinator has a live record of every node, whatever its health: a
    node whose preflight fails is registered (and degraded), not missing. ``seen`` fills
    as records appear, so a timeout can name the nodes still missing. The buckets are the
    coordinator's to create (the operator may only read them), so they are awaited too."""
    nc = await connect(local.nats, "coordinatorctl-up", creds)
    try:
        found: list[Buckets] = []

        async def all_seen() -> bool:
            if not found:
                with contextlib.suppress(BucketNotFoundError, NotFoundError):
                    found.append(await bind(nc.jetstream(), local.cluster))
                if not found:
                    return False
            buckets = found[0]
            records, _ = await decoded(buckets.nodes, NodeRecord)
            gone = (NodeState.LOST, NodeState.AWAY)
            seen.update((r.id, r) for r in records if r.state not in gone)
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
    """Stop every rank, daemon and server ``up`` started, then remove the namespaces,
    veths and bridges of ``up --netns`` (swept by name even when unrecorded). Returns
    what was stopped and removed."""
    stopped: list[str] = []
    daemons = sorted(pids_dir(directory).glob("*.pid"), key=lambda p: _order(p.stem))
    # Coordinators and agents first: a coordinator still running would answer the ranks'
    # exits with a restart, and agents would launch ranks nobody stops. Training ranks and
    # spare interpreters outlive agents by design, so they are stopped explicitly, then
    # the rest.
    # Each tier's processes are signalled together, then waited for together.
    deciders = [p for p in daemons if _order(p.stem) <= 1]
    for tier in (0, 1):
        stopped += _stop_pidfiles([p for p in deciders if _order(p.stem) == tier], timeout)
    workers: list[int] = []
    for run_dir in agent_run_dirs(directory):
        for rank in live_ranks(run_dir):
            workers.append(rank.pid)
            stopped.append(f"rank {rank.job}/rank-{rank.rank} ({rank.pid})")
        for spare in live_spares(run_dir):  # an agent that died left its spares waiting
            workers.append(spare.pid)
            stopped.append(f"spare interpreter ({spare.pid})")
    _kill_groups(workers, timeout)
    for run_dir in agent_run_dirs(directory):
        shutil.rmtree(spare_dir(run_dir), ignore_errors=True)  # their sockets
        node = run_dir.parent.name  # and the RAM its jobs' memory tier holds there
        for job in job_ids(run_dir):
            if memory_store.remove_job_node(memory_store.SHM, job, node):
                stopped.append(f"memory snapshots of {job} on {node}")
            if memory_store.remove_job_staging(memory_store.SHM, job):  # ranks killed above
                stopped.append(f"checkpoint staging of {job}")
            # a killed agent leaves its control socket, in the temp dir for deep run dirs
            JobDir(run_dir, job).control_socket.unlink(missing_ok=True)
    for pidfile in daemons:
        if pidfile not in deciders:
            stopped += _stop_pidfiles([pidfile], timeout)
    warm.remove(directory)  # the template's socket (it was stopped with the rest)
    stopped += ns.remove(directory)
    (directory / "cluster.json").unlink(missing_ok=True)
    return stopped


def _stop_pidfiles(pidfiles: list[Path], timeout: float) -> list[str]:
    live = {f: pid for f in pidfiles if (pid := read_pid(f)) is not None and pid_alive(pid)}
    _kill_groups(list(live.values()), timeout)
    for pidfile in pidfiles:
        pidfile.unlink(missing_ok=True)
    return [f"{f.stem} ({pid})" for f, pid in live.items()]


def _kill_groups(pids: list[int], timeout: float) -> None:
    """SIGTERM each process group, wait up to ``timeout`` for all to end; SIGKILL the
    rest."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not any(pid_alive(p) for p in pids), wait)
            return
