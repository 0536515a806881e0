"""``coordinatorctl down`` on a local cluster stops the coordinators and agents first (so
nobody restarts or launches ranks meanwhile), then the training ranks and spare
interpreters it finds through the agents' run directories (both outlive their agent), then
the rest (the warm template the agents shared among them, its socket removed), and leaves
no PID file of its own behind."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from warm_stand_in import stand_in

from coordinator.ctl import warm
from coordinator.ctl.home import agent_run_dir, pid_file, pids_dir
from coordinator.ctl.local import down
from proto.job import shm_staging_name
from ringmaster import memory_store
from ringmaster.procs import pid_alive, read_pid, start_time
from ringmaster.rundir import JOB_ENV, JobDir, spare_dir, spare_socket


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


def test_down_stops_deciders_then_ranks_then_the_rest(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    rank = detached(procs, **{JOB_ENV: "j1"})
    job = JobDir(agent_run_dir(tmp_path, "node-1"), "j1")
    job.path.mkdir(parents=True)
    job.rank_pid(1).write_text(str(rank))
    spare = detached(procs)  # left waiting by an agent that died
    spares = spare_dir(agent_run_dir(tmp_path, "node-1"))
    spares.mkdir(parents=True)
    started = start_time(spare)
    assert started is not None
    spare_socket(spares, spare, started, "0123456789ab").write_bytes(b"")
    agent, coordinator, sim = detached(procs), detached(procs), detached(procs)
    pids_dir(tmp_path).mkdir()
    pid_file(tmp_path, "nodeagent-node-1").write_text(str(agent))
    pid_file(tmp_path, "coordinator-0").write_text(str(coordinator))
    pid_file(tmp_path, "simulator").write_text(str(sim))
    pid_file(tmp_path, "nats-server").write_text("999999999")  # long gone

    stopped = down(tmp_path, timeout=5)

    assert stopped == [
        f"coordinator-0 ({coordinator})",
        f"nodeagent-node-1 ({agent})",
        f"rank j1/rank-1 ({rank})",
        f"spare interpreter ({spare})",
        f"simulator ({sim})",
    ]
    assert not any(pid_alive(p) for p in (rank, spare, agent, coordinator, sim))
    assert not spares.exists()
    assert not list(pids_dir(tmp_path).iterdir())


def test_down_removes_the_checkpoint_staging_its_killed_ranks_leave_in_ram(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that ends by itself removes its job's staging; one that ``down`` has to kill
    (here: a process that never does) leaves it, as big as the model's state, in RAM."""
    shm = tmp_path / "shm"
    monkeypatch.setattr(memory_store, "SHM", shm)
    rank = detached(procs, **{JOB_ENV: "j1"})
    job = JobDir(agent_run_dir(tmp_path, "node-1"), "j1")
    job.path.mkdir(parents=True)
    job.rank_pid(0).write_text(str(rank))
    staging = shm / shm_staging_name("j1") / "rank-0"
    staging.mkdir(parents=True)
    (staging / "model.pt").write_bytes(b"weights")
    other = shm / shm_staging_name("j2")  # a job this cluster's agents never ran
    other.mkdir()

    stopped = down(tmp_path, timeout=5)

    assert "checkpoint staging of j1" in stopped
    assert not (shm / shm_staging_name("j1")).exists() and other.is_dir()


def test_down_stops_the_warm_template_with_the_rest_and_removes_its_socket(
    tmp_path: Path,
) -> None:
    for made in (tmp_path / "logs", pids_dir(tmp_path)):
        made.mkdir()
    path = warm.start(tmp_path, stand_in(tmp_path))  # as up starts it
    assert warm.await_ready(path, tmp_path / "logs", timeout=30)
    pid = read_pid(pid_file(tmp_path, warm.PROCESS))
    assert pid is not None and pid_alive(pid)
    assert down(tmp_path, timeout=5) == [f"{warm.PROCESS} ({pid})"]
    assert not pid_alive(pid) and not path.exists()
