"""The layout of a node agent's run directory (``nodeagent --run-dir``), in one place.

::

    <run_dir>/epoch                     the newest leader epoch seen (command fencing)
    <run_dir>/sim-knobs.json            rehearsal knobs of a simulated node (inject)
    <run_dir>/probe-port                the peer-probe listener's port, kept across restarts
    <run_dir>/warm-pool.log             what warm interpreters print before they are ranks
    <run_dir>/spares/<pid>-<start>-<stamp>.sock
                                        a warm interpreter's listening socket, named by
                                        its PID, start time and code stamp (see
                                        spare_dir for deep run directories)
    <run_dir>/spares/<pid>-<start>-<stamp>-template.sock
                                        the same for the interpreter the others are
                                        forked from (``trainer.warm_template``)
    <run_dir>/jobs/<job>/spec.json      the job spec the ranks read ($RINGMASTER_JOB_SPEC)
    <run_dir>/jobs/<job>/attempt        the attempt of the job the ranks below belong to
    <run_dir>/jobs/<job>/peers.json     the job's other nodes' probe addresses (its launch)
    <run_dir>/jobs/<job>/rank-<r>.pid   rank r's PID (also its process group's id) and
                                        start time: "<pid> <ticks since boot>"
    <run_dir>/jobs/<job>/rank-<r>.exit  rank r's exit record, which the rank writes just
                                        before it exits: "<pid> <exit status>" (for a
                                        rank forked from a template, the template too,
                                        as it reaps it: "<pid> -<signal>" if killed)
    <run_dir>/jobs/<job>/rank-<r>.beat  rank r's beat (``ringmaster.rankbeat``)
    <run_dir>/jobs/<job>/rank-<r>.log   rank r's stdout and stderr
    <run_dir>/jobs/<job>/pre-start.log  the job's pre-start hook's output
    <run_dir>/jobs/<job>/control.sock   rank 0's control socket (see JobDir.control_socket)

The agent writes it. On a local cluster ``coordinatorctl`` reads it too, to find rank
processes the agent may no longer be there to stop (ranks outlive an agent restart by
design): ``inject NODE kill-worker`` and ``down``. A PID file can outlive its process and
the PID be reused, so a PID counts as a rank only while the process it names started when
the file says (``/proc/<pid>/stat`` field 22; a reused PID starts later). The process's
environment cannot tell: a rank handed to a warm interpreter (``nodeagent.warm_pool``)
got its environment after it started, and ``/proc/<pid>/environ`` shows only the one it
started with. A PID file without a start time (written before start times were
recorded) falls back to the environment marker, ``RINGMASTER_JOB_ID=<job>``, which every
rank started cold carries.

A restarted agent reads it too: it re-adopts the live ranks its predecessor started
(``nodeagent.adoption``), with the job's attempt from ``attempt``. Such a rank is not the
new agent's child, so its exit status cannot be waited for: the rank leaves it in its exit
record (the trainer does, ``ringmaster.rank.termination``), and a rank that dies without one (a
SIGKILL) has an unknown status. A rank forked from a template interpreter is never the
agent's child: the template, its parent, leaves the status it reaps in the record, a
signal included, so the agent knows it as it knows a child's. A launch clears the
previous attempt's PID files, exit records and beats, so whatever is found here belongs to
the attempt ``attempt`` names.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import msgspec

from ringmaster import rank_env
from ringmaster.procs import pid_alive, start_time

JOB_ENV = rank_env.JOB_ID  # every rank's environment holds it
_RANK_PID = re.compile(r"rank-(\d+)\.pid")
# AF_UNIX paths are limited to 108 bytes on Linux, with the terminating NUL; keep a margin.
_SOCKET_PATH_MAX = 100


def epoch_file(run_dir: Path) -> Path:
    return run_dir / "epoch"


SIM_KNOBS_ENV = rank_env.SIM_KNOBS  # set on ranks of simulated nodes only


def probe_port(run_dir: Path) -> Path:
    """The port the agent's peer-probe listener had: a restarted agent listens there again,
    so the peers its jobs' launches named keep reaching it."""
    return run_dir / "probe-port"


def metrics_url(run_dir: Path) -> Path:
    """The URL of the agent's ``/metrics`` as bound, address and port (``nodeagent
    --health-gate`` reads it where the configuration leaves the port to the kernel, and
    the address may be one given on the agent's command line)."""
    return run_dir / "metrics-url"


def sim_knobs(run_dir: Path) -> Path:
    """A simulated node's rehearsal knobs (``proto.faults.SimKnobs``): written by
    ``coordinatorctl inject`` (``slow``, ``nan-loss``), read by the node's ranks."""
    return run_dir / "sim-knobs.json"


def warm_pool_log(run_dir: Path) -> Path:
    """Output of the node's warm interpreters until each becomes a rank (then the rank's
    own log takes over)."""
    return run_dir / "warm-pool.log"


_SPARE = re.compile(r"(\d+)-(\d+)-([0-9a-f]{12})(-template)?\.sock")
_SPARE_NAME_MAX = len("4194304-18446744073709551615-0123456789ab-template.sock")


def spare_dir(run_dir: Path) -> Path:
    """Where the node's warm interpreters listen for their agent, one socket each
    (``nodeagent.warm_pool``): a restarted agent finds them here. In the run directory
    when every name fits AF_UNIX's limit; else a short name derived from it, in the temp
    dir."""
    path = run_dir / "spares"
    if len(os.fsencode(path)) + 1 + _SPARE_NAME_MAX < _SOCKET_PATH_MAX:
        return path
    digest = hashlib.sha1(os.fsencode(run_dir)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"ringmaster-spares-{digest}"


class RecordedSpare(NamedTuple):
    """A warm interpreter's socket and what its name says: whose it is (PID and start
    time, ``ringmaster.procs.start_time``), what code it imported (``stamp``) and whether
    it is the template the node's spares are forked from."""

    pid: int
    started: int
    stamp: str
    path: Path
    template: bool = False


def spare_socket(
    directory: Path, pid: int, started: int, stamp: str, *, template: bool = False
) -> Path:
    return directory / f"{pid}-{started}-{stamp}{'-template' if template else ''}.sock"


def recorded_spares(run_dir: Path) -> tuple[list[RecordedSpare], list[Path]]:
    """The spare sockets under :func:`spare_dir`, and the other files there (sockets of
    an agent that died while starting a spare: nobody can tell whose they are)."""
    spares, other = [], []
    for path in sorted(spare_dir(run_dir).glob("*")):
        if (m := _SPARE.fullmatch(path.name)) is None:
            other.append(path)
        else:
            spares.append(RecordedSpare(int(m[1]), int(m[2]), m[3], path, bool(m[4])))
    return spares, other


def live_spares(run_dir: Path) -> list[RecordedSpare]:
    """The recorded spares whose process still runs (it may have become a rank since)."""
    return [s for s in recorded_spares(run_dir)[0] if spare_running(s)]


def spare_running(spare: RecordedSpare) -> bool:
    """Whether the process the socket names runs: that PID, started at that time."""
    return pid_alive(spare.pid) and start_time(spare.pid) == spare.started


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
    def peers(self) -> Path:
        return self.path / "peers.json"

    def write_peers(self, peers: dict[str, str]) -> None:
        _write_atomic(self.peers, msgspec.json.encode(peers).decode())

    def read_peers(self) -> dict[str, str]:
        """What the job's launch said of its peers; none when unreadable."""
        try:
            return msgspec.json.decode(self.peers.read_bytes(), type=dict[str, str])
        except (OSError, msgspec.DecodeError):
            return {}

    @property
    def pre_start_log(self) -> Path:
        return self.path / "pre-start.log"

    @property
    def attempt(self) -> Path:
        return self.path / "attempt"

    def write_attempt(self, attempt: int) -> None:
        _write_atomic(self.attempt, str(attempt))

    def read_attempt(self) -> int:
        """The attempt the job's ranks belong to; 0 (unknown) without a readable file."""
        try:
            return int(self.attempt.read_text().strip())
        except (OSError, ValueError):
            return 0

    def clear_ranks(self) -> None:
        """Remove the previous attempt's PID files, exit records and beats (its ranks are
        gone; logs stay): what a restarted agent finds is then the current attempt's."""
        for pattern in ("rank-*.pid", "rank-*.exit", "rank-*.beat"):
            for path in self.path.glob(pattern):
                path.unlink(missing_ok=True)
        self.stopping.unlink(missing_ok=True)

    @property
    def stopping(self) -> Path:
        return stopping_beside(self.spec)

    def rank_pid(self, rank: int) -> Path:
        return self.path / f"rank-{rank}.pid"

    def recorded_ranks(self) -> dict[int, tuple[int, int | None]]:
        """Every rank with a PID file here, alive or not: rank → (PID, start time)."""
        found = {}
        for pidfile in self.path.glob("rank-*.pid"):
            match = _RANK_PID.fullmatch(pidfile.name)
            recorded = read_rank_pid(pidfile)
            if match and recorded is not None:
                found[int(match[1])] = recorded
        return found

    def rank_exit(self, rank: int) -> Path:
        return exit_beside(self.spec, rank)

    def record_rank(self, rank: int, pid: int) -> None:
        """Write rank ``rank``'s PID file: its PID and start time (see :func:`is_rank`)."""
        started = start_time(pid)
        self.rank_pid(rank).write_text(f"{pid} {started}" if started is not None else str(pid))

    def rank_log(self, rank: int) -> Path:
        return self.path / f"rank-{rank}.log"

    def rank_beat(self, rank: int) -> Path:
        return beat_beside(self.spec, rank)

    def rank_stacks(self, rank: int) -> Path:
        return stacks_beside(self.spec, rank)

    @property
    def control_socket(self) -> Path:
        """In the job's directory when the path fits AF_UNIX's limit; else a short name
        derived from the directory, in the temp dir (deep run directories exist)."""
        path = self.path / "control.sock"
        if len(os.fsencode(path)) < _SOCKET_PATH_MAX:
            return path
        digest = hashlib.sha1(os.fsencode(self.path)).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"ringmaster-{digest}.sock"


def job_ids(run_dir: Path) -> list[str]:
    """Every job the agent of ``run_dir`` has run (its job dirs), sorted."""
    return sorted(p.name for p in (run_dir / "jobs").glob("*"))


def beat_beside(spec: Path, rank: int) -> Path:
    """Rank ``rank``'s beat in the directory of the job spec ``spec``: how a rank finds it
    from ``$RINGMASTER_JOB_SPEC``."""
    return spec.parent / f"rank-{rank}.beat"


def stacks_beside(spec: Path, rank: int) -> Path:
    """Rank ``rank``'s stacks request (a FIFO the rank reads) beside the job spec ``spec``."""
    return spec.parent / f"rank-{rank}.stacks"


# The agent's fallback ask for a rank's stacks when the FIFO's thread does not answer: the
# rank's ``faulthandler`` on this signal. Not SIGUSR1, which is Slurm's warning before a
# job's end (``--signal=USR1@90``), a preemption notice to the rank (trainer.termination).
STACKS_SIGNAL = signal.SIGUSR2


def stopping_beside(spec: Path) -> Path:
    """The agent's mark beside the job spec ``spec`` that it is stopping the job's ranks: a
    SIGTERM then means "exit now", not a preemption notice to checkpoint for."""
    return spec.parent / "stopping"


def exit_beside(spec: Path, rank: int) -> Path:
    """Rank ``rank``'s exit record in the directory of the job spec ``spec``."""
    return spec.parent / f"rank-{rank}.exit"


class ExitRecord(NamedTuple):
    pid: int
    # the process's exit status (0-255), or minus the signal that killed it (a template
    # reaping a rank it forked knows it, as a parent's ``wait`` does)
    code: int


def write_exit(path: Path, pid: int, code: int) -> None:
    """Leave ``pid``'s exit status in ``path`` atomically (raises ``OSError``)."""
    _write_atomic(path, f"{pid} {code}")


def read_exit(path: Path) -> ExitRecord | None:
    """The exit record in ``path``; None when it is missing or not an exit record."""
    try:
        pid, code = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return None
    return ExitRecord(pid, code)


def _write_atomic(path: Path, text: str) -> None:
    """A reader sees the whole file or the one before, never a partial write."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


class LiveRank(NamedTuple):
    job: str
    rank: int
    pid: int


def is_rank(pid: int, job: str, started: int | None = None) -> bool:
    """Whether ``pid`` is a running rank of ``job``: the process that started at
    ``started`` (clock ticks since boot), or, when the start time is unknown, one that
    carries ``RINGMASTER_JOB_ID=<job>`` in its environment. False for a process that is
    gone, a zombie, or one we may not inspect."""
    if not pid_alive(pid):
        return False
    if started is not None:
        return start_time(pid) == started
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{JOB_ENV}={job}".encode() in environ.split(b"\0")


def read_rank_pid(path: Path) -> tuple[int, int | None] | None:
    """The PID and start time in a rank's PID file (None for a file without one); None
    if the file is missing or not a PID file."""
    try:
        fields = path.read_text().split()
    except FileNotFoundError:
        return None
    try:
        pid = int(fields[0])
        started = int(fields[1]) if len(fields) > 1 else None
    except (IndexError, ValueError):
        return None
    return pid, started


def live_ranks(run_dir: Path) -> list[LiveRank]:
    """Every rank with a PID file under ``run_dir`` that is still running, by job and rank."""
    found: list[LiveRank] = []
    for jobdir in (run_dir / "jobs").glob("*"):
        job = jobdir.name
        for rank, (pid, started) in JobDir(run_dir, job).recorded_ranks().items():
            if is_rank(pid, job, started):
                found.append(LiveRank(job, rank, pid))
    return sorted(found)
