"""The operator's overrides and a user's own script, through coordinatorctl on a local
cluster: pause, resume, checkpoint now, stop (no rank left, by PID); a plain
torch.distributed script with a pre-start hook runs unchanged."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(400)
def test_operator_overrides_and_a_user_script(tmp_path: Path) -> None:
    home = tmp_path / "cluster"
    env = {**os.environ, "RINGMASTER_HOME": str(home)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "coordinator.ctl.main", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )

    def ctl(*args: str) -> str:
        done = run(*args)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def wait(job: str, pred, timeout: float = 120) -> dict:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not pred(s := json.loads(ctl("status", job, "--json"))):
            assert time.monotonic() < deadline, s
            time.sleep(0.2)
        return s

    def kinds(job: str) -> list[str]:
        out = ctl("tail", "--no-follow", "--json", "--job", job)
        return [json.loads(x)["kind"] for x in out.splitlines()]

    ctl("up", "--nodes", "2")
    try:
        job = ctl(
            "start",
            str(ROOT / "examples" / "tiny.toml"),
            "--set",
            "train.steps=100000",
            "--set",
            "checkpoint.every_steps=100000",
            "--set",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
        ).strip()
        wait(job, lambda s: s["state"] == "running" and s["step"] >= 2)
        ctl("pause", job)
        paused = wait(job, lambda s: s["state"] == "paused")
        time.sleep(1.0)
        assert json.loads(ctl("status", job, "--json"))["step"] == paused["step"]
        ctl("resume", job)
        wait(job, lambda s: s["state"] == "running" and s["step"] > paused["step"])
        ctl("checkpoint", job)
        ckpt = wait(job, lambda s: s["last_checkpoint_step"] is not None)
        assert ckpt["last_checkpoint_step"] > paused["step"]
        pids = [int(p.read_text()) for p in home.glob(f"nodes/*/agent/jobs/{job}/rank-*.pid")]
        assert len(pids) == 2
        ctl("stop", job)
        stopped = wait(job, lambda s: s["state"] == "stopped")
        assert stopped["pauses"] == 1
        assert not [p for p in pids if alive(p)]
        seen = kinds(job)
        for kind in ("job.paused", "job.resumed", "job.checkpointed", "job.stopped"):
            assert kind in seen, seen
        again = run("pause", job)
        assert again.returncode == 1 and "already stopped" in again.stderr

        out = tmp_path / "user-out"
        out.mkdir()
        done = run(
            "start",
            str(ROOT / "examples" / "plain_ddp.toml"),
            "--wait",
            "--set",
            f'job.entry=["plain_ddp.py", "--steps", "5", "--out", "{out}"]',
        )
        assert done.returncode == 0, done.stderr
        user = json.loads(ctl("status", done.stdout.strip(), "--json"))
        assert user["state"] == "completed"
        ranks = sorted(out.glob("rank-*.txt"))
        assert [p.name for p in ranks] == ["rank-0.txt", "rank-1.txt"]
        seen_env = ast.literal_eval(ranks[1].read_text().split(" world=")[0])
        assert seen_env["RANK"] == "1" and seen_env["WORLD_SIZE"] == "2"
        assert seen_env["MASTER_ADDR"] == "127.0.0.1" and seen_env["LOCAL_RANK"] == "0"
        hooks = list(home.glob(f"nodes/*/agent/jobs/{user['id']}/pre-start.log"))
        assert len(hooks) == 2 and "pre-start on node-" in hooks[0].read_text()
    finally:
        ctl("down")
