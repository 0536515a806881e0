"""The local cluster's warm template: one ``python -m trainer.warm`` that every simulated
node's agent forks its spares from (``nodeagent.shared_template``).

Each agent starting a template of its own imports torch, DeepSpeed, torchao and the
trainer once per node at every ``up`` (about 4.5 CPU-s each here), nodes that never run a
rank included; on one machine they are the same imports, so ``up`` pays them once. It
starts the template like its other daemons (detached, ``DIR/pids``, ``DIR/logs``), on a
socket it binds and hands over (``proto.warm.LISTEN_FD_ENV``, as an agent does for its
own), and ``down`` stops it with the rest. The socket is a path on the machine's
filesystem, which agents in network namespaces (``up --netns``) reach too.

Spares are on unless ``$RINGMASTER_WARM_RANKS`` is 0, which ``up`` passes on to the agents
as well: with none, no template is started.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from coordinator.ctl.spawn import daemon_env, spawn
from proto.warm import LISTEN_FD_ENV, READY, warm_ranks

PROCESS = "warm-template"  # its PID and log file names
TEMPLATE = (sys.executable, "-m", "trainer.warm")  # what the agents would start each
READY_S = 120.0  # its imports: 5 s on an idle machine, a minute on a busy one
_SOCKET_PATH_MAX = 100  # AF_UNIX's 108 bytes, with a margin


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the agents keep spares (``$RINGMASTER_WARM_RANKS`` is not 0)."""
    return warm_ranks(environ) != 0


def socket_path(directory: Path) -> Path:
    """Where it listens: in the cluster's directory when the path fits AF_UNIX's limit,
    else a short name derived from it, in the temp dir."""
    path = directory / f"{PROCESS}.sock"
    if len(os.fsencode(path)) < _SOCKET_PATH_MAX:
        return path
    digest = hashlib.sha1(os.fsencode(directory.resolve())).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"ringmaster-{PROCESS}-{digest}.sock"


def start(directory: Path, command: Sequence[str] = TEMPLATE) -> Path:
    """Start the template on its socket (a backlog for every agent connecting while it
    imports); the socket."""
    path = socket_path(directory)
    path.unlink(missing_ok=True)  # a crashed cluster's
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(socket.SOMAXCONN)
        fd = listener.fileno()
        env = {**daemon_env(), LISTEN_FD_ENV: str(fd)}
        spawn(PROCESS, list(command), directory, env=env, fds=(fd,))
    return path


def await_ready(path: Path, logs: Path, timeout: float = READY_S) -> bool:
    """Whether the template says READY (its imports done) within ``timeout`` seconds;
    when it does not, the operator is told (ranks start cold until it does)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(timeout)
        conn.connect(str(path))
        with conn.makefile("rb") as words:
            if words.readline() == READY:
                return True
    log = logs / f"{PROCESS}.log"
    print(
        f"ringmaster: the warm template is not ready: ranks start cold; see {log}", file=sys.stderr
    )
    return False


def remove(directory: Path) -> None:
    """Its socket, once it is stopped."""
    socket_path(directory).unlink(missing_ok=True)
