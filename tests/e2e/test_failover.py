"""Leadership under fire: with a standby running, kill -9 the leading coordinator mid-job.
The standby takes the lease within the lease time, continues the job from KV without
restarting it, and the agents refuse commands stamped with the dead leader's epoch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import nats
import pytest

from proto import subjects
from proto.codec import encode, reply_decoder
from proto.commands import ReservePort

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def ctl(home: Path, *args: str) -> str:
    env = {**os.environ, "RINGMASTER_HOME": str(home)}
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


def wait_job(home: Path, job: str, pred, timeout: float = 180) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = json.loads(ctl(home, "status", job, "--json"))
        if pred(status):
            return status
        assert status["state"] not in ("failed", "stopped"), status
        time.sleep(0.2)
    raise AssertionError(f"timed out; last status {status}")


def leaders(home: Path) -> list[dict]:
    rows = [json.loads(x) for x in ctl(home, "tail", "--no-follow", "--json").splitlines()]
    return [e for e in rows if e["kind"] == "coordinator.leader"]


async def stale_command(url: str, epoch: int) -> tuple[bool, str]:
    nc = await nats.connect(url)
    msg = await nc.request(subjects.command("local", "node-0"), encode(ReservePort(epoch=epoch)), 5)
    await nc.close()
    reply = reply_decoder.decode(msg.data)
    return reply.ok, reply.error


@pytest.mark.timeout(400)
def test_standby_takes_over_mid_job_without_a_restart(tmp_path: Path) -> None:
    home = tmp_path / "cluster"
    ctl(home, "up", "--nodes", "2", "--standby")
    try:
        job = ctl(
            home,
            "start",
            str(ROOT / "examples" / "tiny.toml"),
            "--set",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
        ).strip()
        wait_job(home, job, lambda s: s["step"] >= 20)
        [first] = leaders(home)
        old = first["coordinator"]
        pid = int((home / "pids" / f"{old}.pid").read_text())
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while len(leaders(home)) < 2:
            assert time.monotonic() < deadline, "no new leader"
            time.sleep(0.1)
        new = leaders(home)[-1]
        assert new["coordinator"] != old and new["epoch"] > first["epoch"]
        took = datetime.fromisoformat(new["time"]).timestamp() - killed
        assert took < 4.0, f"takeover took {took:.2f} s"
        final = wait_job(home, job, lambda s: s["state"] == "completed")
        assert final["restarts"] == 0 and final["step"] == final["target_steps"]
        url = json.loads((home / "cluster.json").read_text())["nats"]
        ok, error = asyncio.run(stale_command(url, first["epoch"]))
        assert not ok and "stale epoch" in error
        refused = [
            json.loads(x)
            for x in ctl(
                home, "tail", "--no-follow", "--json", "--kind", "command.refused"
            ).splitlines()
        ]
        assert refused and refused[-1]["epoch"] == first["epoch"]
    finally:
        ctl(home, "down")
