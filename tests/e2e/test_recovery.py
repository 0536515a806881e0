"""A rank dies mid-job: the coordinator stops the others, re-rendezvouses and resumes from
the newest durable checkpoint; later, ``down`` mid-job leaves no rank process alive."""

from __future__ import annotations

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
def test_killed_rank_restarts_from_checkpoint_and_down_leaves_no_rank(tmp_path: Path) -> None:
    home = tmp_path / "cluster"
    env = {**os.environ, "RINGMASTER_HOME": str(home)}

    def ctl(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "coordinator.ctl.main", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def status(job: str) -> dict:
        return json.loads(ctl("status", job, "--json"))

    def wait(job: str, pred, timeout: float = 200) -> dict:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not pred(s := status(job)):
            assert s["state"] not in ("failed", "stopped") and time.monotonic() < deadline, s
            time.sleep(0.2)
        return s

    ctl("up", "--nodes", "2")
    try:
        job = ctl(
            "start",
            str(ROOT / "examples" / "tiny.toml"),
            "--set",
            "train.steps=120",
            "--set",
            "checkpoint.every_steps=20",
            "--set",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
        ).strip()
        before = wait(job, lambda s: (s["last_checkpoint_step"] or 0) >= 40)
        ctl("inject", "node-1", "kill-worker")
        final = wait(job, lambda s: s["state"] == "completed")
        assert final["restarts"] == 1 and final["step"] == 120
        events = [
            json.loads(x) for x in ctl("tail", "--no-follow", "--json", "--job", job).splitlines()
        ]
        [restarted] = [e for e in events if e["kind"] == "job.restarted"]
        assert restarted["from_step"] >= before["last_checkpoint_step"]
        kinds = [e["kind"] for e in events]
        assert kinds.index("job.recovering") < kinds.index("job.restarted")
        assert final["goodput"]["recovery"] > 0

        second = ctl(
            "start",
            str(ROOT / "examples" / "tiny.toml"),
            "--set",
            "train.steps=100000",
            "--set",
            f"checkpoint.dir={tmp_path / 'ckpt2'}",
        ).strip()
        wait(second, lambda s: s["step"] >= 3)
        pidfiles = list(home.glob(f"nodes/*/agent/jobs/{second}/rank-*.pid"))
        pids = [int(p.read_text()) for p in pidfiles]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        ctl("down")
    assert not [p for p in pids if alive(p)], "down left training ranks running"
