"""Where the local cluster lives, and how every command finds the bus.

The directory is ``--dir``, else ``$RINGMASTER_HOME``, else ``$XDG_STATE_HOME/ringmaster``
(``~/.local/state/ringmaster``). ``up`` writes ``cluster.json`` there; the NATS URL is
``--nats``, else ``$RINGMASTER_NATS``, else that file's, else ``nats://127.0.0.1:4222``;
the creds likewise: ``--creds``, else ``$RINGMASTER_CREDS``, else the operator creds ``up``
wrote in ``secrets/``, else none.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import msgspec

from coordinator.auth import OPERATOR, creds_path
from ringmaster.auth import ENV as ENV_CREDS
from ringmaster.bus import DEFAULT_URL
from ringmaster.procs import pid_alive, read_pid


class LocalCluster(msgspec.Struct, kw_only=True):
    nats: str
    cluster: str
    nodes: list[str]
    gpus_per_node: int
    coordinators: list[str]
    auth: bool = False  # users and creds in DIR/secrets (coordinator.auth)


def home(explicit: str | None = None) -> Path:
    if explicit:
        return Path(explicit).resolve()
    if env := os.environ.get("RINGMASTER_HOME"):
        return Path(env).resolve()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "ringmaster"


def read_cluster(directory: Path) -> LocalCluster | None:
    with contextlib.suppress(FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return msgspec.json.decode((directory / "cluster.json").read_bytes(), type=LocalCluster)
    return None


def pids_dir(directory: Path) -> Path:
    """Where ``up`` keeps the PID of each process it started (``down`` stops them all)."""
    return directory / "pids"


def pid_file(directory: Path, process: str) -> Path:
    return pids_dir(directory) / f"{process}.pid"


def agent_process(node: str) -> str:
    """The name ``up`` gives the agent of ``node``: its PID and log file names."""
    return f"nodeagent-{node}"


def nodes_root(directory: Path) -> Path:
    """Where the simulator keeps each node's tree (``<root>/<node>``)."""
    return directory / "nodes"


def agent_run_dir(directory: Path, node: str) -> Path:
    """The ``--run-dir`` ``up`` gives the agent of ``node``; its layout is
    ``ringmaster.rundir``'s."""
    return nodes_root(directory) / node / "agent"


def agent_run_dirs(directory: Path) -> list[Path]:
    """The run directories of every node agent this local cluster ever started."""
    return sorted(p for p in nodes_root(directory).glob("*/agent") if p.is_dir())


def running(directory: Path) -> LocalCluster | None:
    """The local cluster in ``directory`` if its NATS server is alive."""
    cluster = read_cluster(directory)
    pid = read_pid(pid_file(directory, "nats-server"))
    if cluster is not None and pid is not None and pid_alive(pid):
        return cluster
    return None


def resolve(nats: str | None, cluster: str | None, directory: str | None) -> tuple[str, str]:
    """(NATS URL, cluster name) by the documented precedence."""
    local = running(home(directory))
    url = nats or os.environ.get("RINGMASTER_NATS") or (local.nats if local else DEFAULT_URL)
    name = cluster or os.environ.get("RINGMASTER_CLUSTER") or (local.cluster if local else "local")
    return url, name


def resolve_creds(explicit: str | None, directory: str | None) -> str | None:
    """The creds file by the documented precedence (None: connect without auth)."""
    if chosen := explicit or os.environ.get(ENV_CREDS):
        return chosen
    local = running(home(directory))
    return str(creds_path(home(directory), OPERATOR)) if local and local.auth else None
