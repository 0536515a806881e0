"""Where the local cluster lives, and how every command finds the bus.

The directory is ``--dir``, else ``$RINGMASTER_HOME``, else ``$XDG_STATE_HOME/ringmaster``
(``~/.local/state/ringmaster``). ``up`` writes ``cluster.json`` there; the NATS URL is
``--nats``, else ``$RINGMASTER_NATS``, else that file's, else ``nats://127.0.0.1:4222``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import msgspec

from ringmaster.bus import DEFAULT_URL


class LocalCluster(msgspec.Struct, kw_only=True):
    nats: str
    cluster: str
    nodes: list[str]
    gpus_per_node: int
    coordinators: list[str]


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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return True


def read_pid(path: Path) -> int | None:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return int(path.read_text().strip())
    return None


def running(directory: Path) -> LocalCluster | None:
    """The local cluster in ``directory`` if its NATS server is alive."""
    cluster = read_cluster(directory)
    pid = read_pid(directory / "pids" / "nats-server.pid")
    if cluster is not None and pid is not None and pid_alive(pid):
        return cluster
    return None


def resolve(nats: str | None, cluster: str | None, directory: str | None) -> tuple[str, str]:
    """(NATS URL, cluster name) by the documented precedence."""
    local = running(home(directory))
    url = nats or os.environ.get("RINGMASTER_NATS") or (local.nats if local else DEFAULT_URL)
    name = cluster or os.environ.get("RINGMASTER_CLUSTER") or (local.cluster if local else "local")
    return url, name
