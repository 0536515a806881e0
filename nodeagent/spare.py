"""One warm interpreter as the pool sees it (``nodeagent.warm_pool``): a spare, or the
template spares are forked from; its process and connection, how one is started with
``exec``, whether it can serve a rank's environment, and how it ends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from nodeagent.adoption import AdoptedRank, RankProcess
from proto.warm import LISTEN_FD_ENV, READY
from ringmaster.procs import pid_alive, start_time
from ringmaster.rundir import spare_socket

log = structlog.get_logger()


# Read when torch, DeepSpeed, OpenMP, the dynamic loader or Python itself start: a spare
# started under other values cannot become a rank that needs these. What torch reads when
# a process group or CUDA starts (TORCH_NCCL_*, NCCL_*, PYTORCH_CUDA_ALLOC_CONF) is read
# after the hand-over, in the rank's environment.
IMPORT_TIME = (
    "PYTHON",
    "LD_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH_LOGS",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "DS_ACCELERATOR",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
)
APPLIED_BY_WORKER = frozenset({"OMP_NUM_THREADS"})  # the worker sets its threads itself


def import_time_difference(spare: Mapping[str, str], rank: Mapping[str, str]) -> str | None:
    """The first variable read at import time whose value differs between the spare's
    environment and the rank's (set in one and not the other counts); None when a spare
    can become this rank."""
    for name in sorted(set(spare) | set(rank)):
        if name in APPLIED_BY_WORKER or not name.startswith(IMPORT_TIME):
            continue
        if spare.get(name) != rank.get(name):
            return name
    return None


@dataclass(eq=False)
class Spare:
    """A warm interpreter and the pool's connection to it. ``child`` is None for one this
    agent did not start (adopted from the agent before it, forked from the template, or a
    template shared with other agents): known by its PID and start time, not waitable.
    A ``shared`` one is only ever disconnected from (:func:`kill`): the other agents'
    spares are forked from it."""

    pid: int
    started: int | None
    env: dict[str, str]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    socket: Path
    child: asyncio.subprocess.Process | None = None
    born: float = field(default_factory=time.monotonic)
    ready: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # ready, or dead
    shared: bool = False

    def alive(self) -> bool:
        """Running; for a shared template, also still connected to (a connection dropped
        ends its use here, though it serves on)."""
        if self.child is not None:
            return self.child.returncode is None
        if self.shared and self.writer.is_closing():
            return False
        return pid_alive(self.pid) and start_time(self.pid) == self.started

    def as_rank(self, job: str, exit_record: Path) -> RankProcess:
        """The rank's process: the child itself, or a spare that is not watched as an
        adopted rank is (its status from its exit record, which a forked spare's template
        writes as it reaps it)."""
        if self.child is not None:
            return self.child
        return AdoptedRank(job, self.pid, self.started, exit_record)


async def settle(spare: Spare) -> bool:
    """Read its READY (sent once its imports are done); whether it came."""
    word = b""
    try:
        with contextlib.suppress(OSError):
            word = await spare.reader.readline()
    finally:
        spare.ready = word == READY
        spare.settled.set()
    return spare.ready


def close(spare: Spare) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        spare.writer.close()


async def kill(spare: Spare) -> int | None:
    """End a spare that is not a rank (its whole session), reap it and remove its socket;
    its exit status (None for an adopted one, which is nobody's child here). A shared
    template is only disconnected from: it serves the other agents on."""
    close(spare)
    if spare.shared:
        return None
    spare.socket.unlink(missing_ok=True)
    if spare.alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(spare.pid, signal.SIGKILL)
    if spare.child is not None:
        return await spare.child.wait()
    return None


async def start(
    command: Sequence[str],
    directory: Path,
    stamp: str,
    env: Mapping[str, str],
    log_path: Path,
    *,
    template: bool,
) -> Spare | None:
    """A new interpreter (``exec``) in its own session, listening on a socket bound here
    and named, once its PID is known, where a restarted agent finds it; connected to, its
    READY to come. ``env``: its whole environment; ``template``: named as the template."""
    fresh = directory / f"new-{uuid.uuid4().hex[:12]}.sock"
    try:
        with contextlib.closing(_listening(fresh, log_path)) as sock, log_path.open("ab") as logf:
            proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                env={**env, LISTEN_FD_ENV: str(sock.fileno())},
                pass_fds=(sock.fileno(),),
                start_new_session=True,
            )
        path, started = _named(fresh, proc.pid, stamp, template=template)
        reader, writer = await asyncio.open_unix_connection(str(path))
    except OSError as exc:
        fresh.unlink(missing_ok=True)
        log.warning("cannot start a warm interpreter", error=str(exc))
        return None
    return Spare(proc.pid, started, dict(env), reader, writer, path, child=proc)


async def connect(
    fresh: Path, pid: int, stamp: str, env: dict[str, str], *, template: bool = False
) -> Spare | None:
    """A spare forked from the template (or the template's successor), listening at
    ``fresh``: its socket named where a restarted agent finds it, connected to (its READY
    to come)."""
    path = fresh
    try:
        path, started = _named(fresh, pid, stamp, template=template)
        reader, writer = await asyncio.open_unix_connection(str(path))
    except OSError as exc:
        path.unlink(missing_ok=True)
        log.warning("cannot reach a forked warm interpreter", pid=pid, error=str(exc))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)  # (it may not lead its own session yet)
        return None
    return Spare(pid, started, env, reader, writer, path)


def _listening(path: Path, log_path: Path) -> socket.socket:
    """A Unix socket listening at ``path`` (its directory made, the log's too)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        sock.listen(1)
    except OSError:
        sock.close()
        raise
    return sock


def _named(fresh: Path, pid: int, stamp: str, *, template: bool) -> tuple[Path, int | None]:
    """The socket at ``fresh`` renamed after its process (``ringmaster.rundir.spare_socket``),
    and the process's start time; left as it is when that is unknown (the process is gone)."""
    started = start_time(pid)
    if started is None:
        return fresh, None
    path = spare_socket(fresh.parent, pid, started, stamp, template=template)
    fresh.rename(path)
    return path, started
