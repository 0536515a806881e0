"""The layout of a node agent's run directory (``nodeagent --run-dir``), in one place.

::

    <run_dir>/epoch                     the newest leader epoch seen (command fencing)
    <run_dir>/sim-knobs.json            rehearsal knobs of a simulated node (inject)
    <run_dir>/jobs/<job>/spec.json      the job spec the ranks read ($RINGMASTER_JOB_SPEC)
    <run_dir>/jobs/<job>/rank-<r>.pid   rank r's PID, also its process group's id
    <run_dir>/jobs/<job>/rank-<r>.log   rank r's stdout and stderr
    <run_dir>/jobs/<job>/pre-start.log  the job's pre-start hook's output
    <run_dir>/jobs/<job>/control.sock   rank 0's control socket (see JobDir.control_socket)

The agent writes it. On a local cluster ``coordinatorctl`` reads it too, to find rank
processes the agent may no longer be there to stop (ranks outlive an agent restart by
design): ``inject NODE kill-worker`` and ``down``. A PID file can outlive its process and
the PID be reused, so a PID counts as a rank only while the process carries the rank
marker, ``RINGMASTER_JOB_ID=<job>``, in its environment (the agent sets it on every rank).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ringmaster.procs import pid_alive, read_pid

JOB_ENV = "RINGMASTER_JOB_ID"  # the rank marker: every rank's environment holds it
_RANK_PID = re.compile(r"rank-(\d+)\.pid")
# AF_UNIX paths are limited to 108 bytes on Linux, with the terminating NUL; keep a margin.
_SOCKET_PATH_MAX = 100


def epoch_file(run_dir: Path) -> Path:
    return run_dir / "epoch"


SIM_KNOBS_ENV = "RINGMASTER_SIM_KNOBS"  # set on ranks of simulated nodes only


def sim_knobs(run_dir: Path) -> Path:
    """A simulated node's rehearsal knobs (``proto.faults.SimKnobs``): written by
    ``coordinatorctl inject`` (``slow``, ``nan-loss``), read by the node's ranks."""
    return run_dir / "sim-knobs.json"


def compile_cache(run_dir: Path) -> Path:
    """Compiled code of every job's ranks on this node (the trainer's
    ``RINGMASTER_COMPILE_CACHE``): it outlives ranks, so a restarted rank loads what its
    predecessor compiled instead of compiling again."""
    return run_dir / "compile-cache"


@dataclass(frozen=True)
class JobDir:
    """One job's directory under a run directory, and the files the agent keeps in it."""

    run_dir: Path
    job: str

    @property
    def path(self) -> Path:
        return self.run_dir / "jobs" / self.job

    @property
    def spec(self) -> Path:
        return self.path / "spec.json"

    @property
    def pre_start_log(self) -> Path:
        return self.path / "pre-start.log"

    def rank_pid(self, rank: int) -> Path:
        return self.path / f"rank-{rank}.pid"

    def rank_log(self, rank: int) -> Path:
        return self.path / f"rank-{rank}.log"

    @property
    def control_socket(self) -> Path:
        """In the job's directory when the path fits AF_UNIX's limit; else a short name
        derived from the directory, in the temp dir (deep run directories exist)."""
        path = self.path / "control.sock"
        if len(os.fsencode(path)) < _SOCKET_PATH_MAX:
            return path
        digest = hashlib.sha1(os.fsencode(self.path)).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"ringmaster-{digest}.sock"


class LiveRank(NamedTuple):
    job: str
    rank: int
    pid: int


def is_rank(pid: int, job: str) -> bool:
    """Whether ``pid`` is a running rank of ``job``: it carries the rank marker. False for
    a process that is gone, a zombie, or one whose environment we may not read."""
    if not pid_alive(pid):
        return False
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{JOB_ENV}={job}".encode() in environ.split(b"\0")


def live_ranks(run_dir: Path) -> list[LiveRank]:
    """Every rank with a PID file under ``run_dir`` that is still running, by job and rank."""
    found: list[LiveRank] = []
    for pidfile in (run_dir / "jobs").glob("*/rank-*.pid"):
        match = _RANK_PID.fullmatch(pidfile.name)
        pid = read_pid(pidfile)
        job = pidfile.parent.name
        if match and pid is not None and is_rank(pid, job):
            found.append(LiveRank(job, int(match[1]), pid))
    return sorted(found)
