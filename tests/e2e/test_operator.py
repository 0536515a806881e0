"""The operator's overrides and a user's own script, through coordinatorctl on a local
cluster: pause, resume, checkpoint now, stop (no rank left, by PID); a plain
torch.distributed script with a pre-start hook runs unchanged."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from cli_harness import EXAMPLES, Ctl, daemon_addresses

from coordinator.ctl.home import agent_run_dirs
from ringmaster.procs import pid_alive
from ringmaster.rundir import JobDir

pytestmark = pytest.mark.slow


@pytest.mark.shared_cluster(nodes=2)
@pytest.mark.timeout(400)
def test_operator_overrides_and_a_user_script(ctl: Ctl, tmp_path: Path) -> None:
    ctl("up", "--nodes", "2")
    job = ctl.start(
        "tiny.toml",
        "train.steps=100000",
        "checkpoint.every_steps=100000",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    ctl.wait(job, lambda s: s["state"] == "running" and s["step"] >= 2)
    ctl("pause", job)
    paused = ctl.wait(job, lambda s: s["state"] == "paused")
    # a second of the leader's own bookkeeping later (it rewrites the record every tick),
    # still paused at the same step
    held = ctl.wait(job, lambda s: s["updated_at"] >= paused["updated_at"] + 1.0)
    assert held["state"] == "paused" and held["step"] == paused["step"]
    ctl("resume", job)
    ctl.wait(job, lambda s: s["state"] == "running" and s["step"] > paused["step"])
    ctl("checkpoint", job)
    ckpt = ctl.wait(job, lambda s: s["last_checkpoint_step"] is not None)
    assert ckpt["last_checkpoint_step"] > paused["step"]
    pids = ctl.ranks(job)
    assert len(pids) == 2
    ctl("stop", job)
    stopped = ctl.wait(job, lambda s: s["state"] == "stopped")
    assert stopped["pauses"] == 1
    assert not [p for p in pids if pid_alive(p)]
    seen = [e["kind"] for e in ctl.events("--job", job)]
    for kind in ("job.paused", "job.resumed", "job.checkpointed", "job.stopped"):
        assert kind in seen, seen
    again = ctl.run("pause", job)
    assert again.returncode == 1 and "already stopped" in again.stderr

    out = tmp_path / "user-out"
    out.mkdir()
    done = ctl.run(
        "start",
        str(EXAMPLES / "plain_ddp.toml"),
        "--wait",
        "--set",
        f'job.entry=["plain_ddp.py", "--steps", "5", "--out", "{out}"]',
    )
    assert done.returncode == 0, done.stderr
    user = ctl.status(done.stdout.strip())
    assert user["state"] == "completed"
    ranks = sorted(out.glob("rank-*.txt"))
    assert [p.name for p in ranks] == ["rank-0.txt", "rank-1.txt"]
    seen_env = ast.literal_eval(ranks[1].read_text().split(" world=")[0])
    assert seen_env["RANK"] == "1" and seen_env["WORLD_SIZE"] == "2"
    assert seen_env["MASTER_ADDR"] in daemon_addresses(ctl.home, "data"), seen_env
    assert seen_env["LOCAL_RANK"] == "0"
    hooks = [JobDir(d, user["id"]).pre_start_log for d in agent_run_dirs(ctl.home)]
    hooks = [hook for hook in hooks if hook.exists()]
    assert len(hooks) == 2 and "pre-start on node-" in hooks[0].read_text()
