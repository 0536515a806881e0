"""The agent's run-dir layout as coordinatorctl reads it: which PID files are live ranks.

A PID file outlives its process and a PID can be reused, so only the running process that
started when the file says counts (or, for a file without a start time, one that carries
the rank marker of that very job)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ringmaster.procs import pid_alive, start_time
from ringmaster.rundir import (
    JOB_ENV,
    JobDir,
    LiveRank,
    is_rank,
    live_ranks,
    live_spares,
    recorded_spares,
    spare_dir,
    spare_socket,
)

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
Spawn = Callable[..., "subprocess.Popen[bytes]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start sleepers with extra environment; every one is killed and reaped at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(**env: str) -> subprocess.Popen[bytes]:
        inherited = {k: v for k, v in os.environ.items() if k != JOB_ENV}
        procs.append(subprocess.Popen(SLEEP, env={**inherited, **env}))
        return procs[-1]

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_live_ranks_are_running_processes_marked_with_their_job(
    tmp_path: Path, spawn: Spawn
) -> None:
    job = JobDir(tmp_path, "j1")
    job.path.mkdir(parents=True)
    rank0 = spawn(**{JOB_ENV: "j1"})
    rank3 = spawn(**{JOB_ENV: "j1"})
    stranger = spawn()  # a reused PID: some other process
    other_job = spawn(**{JOB_ENV: "j2"})
    gone = spawn(**{JOB_ENV: "j1"})
    gone.kill()
    gone.wait()
    for rank, pid in ((0, rank0.pid), (3, rank3.pid), (1, stranger.pid), (2, other_job.pid)):
        job.rank_pid(rank).write_text(str(pid))
    job.rank_pid(4).write_text(str(gone.pid))
    job.rank_pid(5).write_text("")  # written but not yet filled
    (job.path / "rank-x.pid").write_text(str(rank0.pid))  # not a rank's file
    assert live_ranks(tmp_path) == [LiveRank("j1", 0, rank0.pid), LiveRank("j1", 3, rank3.pid)]


def test_a_zombie_is_not_a_live_rank(spawn: Spawn) -> None:
    rank = spawn(**{JOB_ENV: "j1"})
    rank.kill()
    os.waitid(os.P_PID, rank.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    assert not pid_alive(rank.pid) and not is_rank(rank.pid, "j1")


def test_no_jobs_directory_means_no_ranks(tmp_path: Path) -> None:
    assert live_ranks(tmp_path / "never-started") == []


def test_job_files(tmp_path: Path) -> None:
    job = JobDir(tmp_path, "j1")
    assert job.path == tmp_path / "jobs" / "j1"
    assert job.spec == job.path / "spec.json"
    assert job.rank_pid(2) == job.path / "rank-2.pid"
    assert job.rank_log(2) == job.path / "rank-2.log"
    assert job.pre_start_log == job.path / "pre-start.log"


def test_long_job_directories_get_a_short_control_socket(tmp_path: Path) -> None:
    assert JobDir(tmp_path, "j1").control_socket == tmp_path / "jobs" / "j1" / "control.sock"
    deep = tmp_path / ("x" * 120)
    path = JobDir(deep, "j1").control_socket
    assert len(os.fsencode(path)) < 100 and path != JobDir(deep, "j2").control_socket


def test_spare_sockets_fit_and_name_their_process(tmp_path: Path, spawn: Spawn) -> None:
    assert spare_dir(Path("/var/lib/ringmaster")) == Path("/var/lib/ringmaster/spares")
    deep = tmp_path / ("x" * 120)
    longest = spare_socket(spare_dir(deep), 4194304, 2**64 - 1, "0123456789ab", template=True)
    assert len(os.fsencode(longest)) < 100 and spare_dir(deep) != spare_dir(deep / "y")
    directory = spare_dir(tmp_path)  # in the temp dir: pytest's own paths are long
    directory.mkdir()
    try:
        live, gone = spawn(), spawn()
        for proc, template in ((live, True), (gone, False)):
            started = start_time(proc.pid)
            assert started is not None
            spare_socket(directory, proc.pid, started, "0123456789ab", template=template).touch()
        (directory / "new-0a1b.sock").touch()  # its agent died before naming it
        gone.kill()
        gone.wait()
        recorded, unnamed = recorded_spares(tmp_path)
        assert sorted((s.pid, s.template) for s in recorded) == sorted(
            [(live.pid, True), (gone.pid, False)]
        )
        assert [p.name for p in unnamed] == ["new-0a1b.sock"]
        assert [s.pid for s in live_spares(tmp_path)] == [live.pid]
    finally:
        shutil.rmtree(directory)


def test_a_pid_file_with_a_start_time_names_one_process(tmp_path: Path, spawn: Spawn) -> None:
    """A rank that became one after it started (a warm interpreter) carries no marker in
    its environment; its PID file's start time identifies it, and a PID reused by a
    process that started at another time is not it."""
    job = JobDir(tmp_path, "j1")
    job.path.mkdir(parents=True)
    warm, reused = spawn(), spawn()  # neither carries the marker
    job.record_rank(0, warm.pid)
    started = start_time(reused.pid)
    assert started is not None
    job.rank_pid(1).write_text(f"{reused.pid} {started - 1}")  # the PID's earlier owner
    assert job.rank_pid(0).read_text() == f"{warm.pid} {start_time(warm.pid)}"
    assert live_ranks(tmp_path) == [LiveRank("j1", 0, warm.pid)]
    assert is_rank(reused.pid, "j1", started) and not is_rank(reused.pid, "j1", started - 1)
    warm.kill()
    warm.wait()
    assert live_ranks(tmp_path) == []
