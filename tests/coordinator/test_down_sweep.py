"""``down`` removes what a killed agent could not: the control socket of each of its jobs,
which sits in the temp dir when the run directory is too deep for AF_UNIX's limit; and the
socket of the cluster's warm template, there too for a deep cluster directory."""

from __future__ import annotations

import socket
from pathlib import Path

from coordinator.ctl import local, warm
from coordinator.ctl.home import agent_run_dir
from ringmaster.rundir import JobDir


def test_down_removes_a_dead_agents_control_socket_from_the_temp_dir(tmp_path: Path) -> None:
    home = tmp_path / ("deep-" * 20) / "cluster"  # a run dir past AF_UNIX's path limit
    jobdir = JobDir(agent_run_dir(home, "node-0"), "job-1")
    jobdir.path.mkdir(parents=True)
    path = jobdir.control_socket
    assert not path.is_relative_to(home), path  # where a deep run dir's socket goes
    with socket.socket(socket.AF_UNIX) as left:  # the agent died without closing it
        left.bind(str(path))
    assert path.exists()
    local.down(home)
    assert not path.exists()


def test_down_removes_the_warm_templates_socket_from_the_temp_dir(tmp_path: Path) -> None:
    home = tmp_path / ("deep-" * 20) / "cluster"
    home.mkdir(parents=True)
    path = warm.socket_path(home)
    assert not path.is_relative_to(home), path
    with socket.socket(socket.AF_UNIX) as left:  # the template was killed, its socket left
        left.bind(str(path))
    local.down(home)
    assert not path.exists()
