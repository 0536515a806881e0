"""``coordinatorctl down`` on a local cluster stops the training ranks it finds through the
agents' run directories (ranks outlive their agent), then every daemon ``up`` started, and
leaves no PID file of its own behind."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.ctl.home import agent_run_dir, pid_file, pids_dir
from coordinator.ctl.local import down
from ringmaster.procs import pid_alive
from ringmaster.rundir import JOB_ENV, JobDir


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def detached(procs: list[subprocess.Popen[bytes]], **env: str) -> int:
    """A process in its own session, as ``up`` and the agent start theirs."""
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    procs.append(subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True))
    return procs[-1].pid


def test_down_stops_ranks_then_daemons(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    rank = detached(procs, **{JOB_ENV: "j1"})
    job = JobDir(agent_run_dir(tmp_path, "node-1"), "j1")
    job.path.mkdir(parents=True)
    job.rank_pid(1).write_text(str(rank))
    agent = detached(procs)
    pids_dir(tmp_path).mkdir()
    pid_file(tmp_path, "nodeagent-node-1").write_text(str(agent))
    pid_file(tmp_path, "simulator").write_text("999999999")  # long gone

    stopped = down(tmp_path, timeout=5)

    assert stopped == [f"rank j1/rank-1 ({rank})", f"nodeagent-node-1 ({agent})"]
    assert not pid_alive(rank) and not pid_alive(agent)
    assert not list(pids_dir(tmp_path).iterdir())
