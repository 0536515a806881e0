"""A real node beside a simulated one: ``join`` starts an agent on this machine's own
hardware and network stack (stock sysctls, no chrony; no GPU here, so the NVML collectors
report themselves unavailable), it registers ready, warnings and all, and a 2-node job
runs one rank on it, on CPU, to completion; ``down`` stops it with the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_harness import Ctl

from coordinator.ctl.home import agent_process, agent_run_dir, pid_file
from ringmaster.procs import pid_alive, read_pid

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_a_real_node_runs_a_rank_beside_a_simulated_one(ctl: Ctl, tmp_path: Path) -> None:
    ctl("up", "--nodes", "1")
    joined = ctl.run("join", "real-0")
    assert joined.returncode == 0, joined.stderr
    assert "real-0 joined" in joined.stderr and "ready" in joined.stderr, joined.stderr
    nodes = {n["id"]: n for n in ctl.status()["nodes"]}
    real = nodes["real-0"]
    assert real["state"] == "ready" and not real["simulated"], real
    assert real["gpus"] == 1 and real["telemetry"]["gpus"] == [], real  # a CPU slot
    log = (ctl.home / "logs" / f"{agent_process('real-0')}.log").read_text()
    assert "collector failed" not in log and "Traceback" not in log, log

    job = ctl.start("tiny.toml", "train.steps=30", f"checkpoint.dir={tmp_path / 'ckpt'}")
    final = ctl.wait(job, lambda s: s["state"] == "completed", timeout=150)
    assert sorted(final["nodes"]) == ["node-0", "real-0"] and final["restarts"] == 0, final
    exits = {e["node"]: e for e in ctl.events("--job", job, "--kind", "worker.exited")}
    assert set(exits) <= {"node-0", "real-0"} and exits["real-0"]["exit_code"] == 0, exits
    rank = exits["real-0"]["rank"]
    rank_log = agent_run_dir(ctl.home, "real-0") / "jobs" / job / f"rank-{rank}.log"
    assert rank_log.exists(), rank_log

    agent = read_pid(pid_file(ctl.home, agent_process("real-0")))
    assert agent is not None and pid_alive(agent)
    ctl("down")
    assert not pid_alive(agent)
