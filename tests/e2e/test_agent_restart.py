"""An agent crashes under a training job and is started again as systemd would start it
(``inject NODE restart-agent``): it adopts the ranks its predecessor started, so their
exits still reach the coordinator — the job completes, and a rank killed afterwards is
restarted like any other, warm, in a spare interpreter the dead agent had started."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cli_harness import WARM, Ctl, eventually

from coordinator.ctl.home import agent_process, agent_run_dir, pid_file
from proto.faults import PROCESS_FAULTS, RestartAgentFault, parse_fault
from ringmaster.procs import pid_alive, read_pid
from ringmaster.rundir import live_ranks, live_spares

pytestmark = pytest.mark.slow


def restart_agent(ctl: Ctl, node: str) -> None:
    """``inject NODE restart-agent``; returns once the new agent has adopted the ranks."""
    log = ctl.home / "logs" / f"{agent_process(node)}.log"
    before = log.read_text().count("ranks adopted")
    old = read_pid(pid_file(ctl.home, agent_process(node)))
    said = ctl("inject", node, "restart-agent")
    new = read_pid(pid_file(ctl.home, agent_process(node)))
    assert old is not None and new is not None and new != old, said
    assert not pid_alive(old) and pid_alive(new)
    eventually(
        lambda: log.read_text().count("ranks adopted") > before,
        60,
        lambda: f"the restarted agent of {node} adopted no ranks; see {log}",
        0.2,
    )


@pytest.mark.timeout(600)
def test_a_job_completes_across_an_agent_restart(ctl: Ctl, tmp_path: Path) -> None:
    assert isinstance(parse_fault("restart-agent"), RestartAgentFault)
    assert RestartAgentFault in PROCESS_FAULTS  # carried out by coordinatorctl, not the simulator
    # The last save waits for the step-50 checkpoint, which waits for the gate: the ranks
    # cannot finish before their agent is back, however fast this machine is; and they
    # train meanwhile (a silent node whose ranks make no steps would be lost).
    gate = tmp_path / "gate"
    ctl.env["RINGMASTER_TEST_PERSIST_GATE"] = str(gate)
    ctl("up", "--nodes", "2")
    job = ctl.start(
        "tiny.toml",
        "train.steps=60",
        "checkpoint.every_steps=50",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    ctl.wait(job, lambda s: s["step"] >= 3)
    ranks = ctl.ranks(job)
    restart_agent(ctl, "node-1")
    assert ctl.ranks(job) == ranks, "the ranks must outlive their agent"
    gate.touch()
    final = ctl.wait(job, lambda s: s["state"] == "completed", timeout=300)
    assert final["step"] == 60 and final["restarts"] == 0
    # an agent restart is no page: away at most (a warning), never lost
    assert not ctl.events("--kind", "node.lost"), ctl.events("--kind", "node.*")


@pytest.mark.timeout(600)
def test_a_rank_killed_after_an_agent_restart_is_restarted(ctl: Ctl, tmp_path: Path) -> None:
    ctl.env[WARM] = "1"  # the restarted agent must adopt its predecessor's spare
    ctl("up", "--nodes", "2")
    job = ctl.start("tiny.toml", "train.steps=100000", f"checkpoint.dir={tmp_path / 'ckpt'}")
    ctl.wait(job, lambda s: s["step"] >= 2)
    run_dir = agent_run_dir(ctl.home, "node-1")
    spares = eventually(
        lambda: {s.pid for s in live_spares(run_dir)},
        120,
        lambda: "node-1 has no spare interpreter",
        0.2,
    )
    restart_agent(ctl, "node-1")
    assert ctl.status(job)["restarts"] == 0  # the agent's restart is not the job's
    killed = time.monotonic()
    ctl("inject", "node-1", "kill-worker")
    back = ctl.wait(job, lambda s: s["restarts"] >= 1 and s["state"] == "running", timeout=300)
    print(
        f"kill-worker after an agent restart: training again in {time.monotonic() - killed:.1f} s"
    )
    later = ctl.wait(job, lambda s: s["step"] > back["step"], timeout=300)
    events = ctl.events("--job", job)
    said = [f"{e['kind']}: {e.get('message', '')}" for e in events]
    assert later["restarts"] == 1 and later["state"] == "running", said
    assert [e["kind"] for e in events].count("job.restarted") == 1, said
    rank = {r.pid for r in live_ranks(run_dir) if r.job == job}
    assert rank & spares, f"rank {rank} of node-1 is in none of its old spares {spares}"
