"""Leadership under fire: with a standby running, kill -9 the leading coordinator mid-job.
The standby takes the lease within the lease time, continues the job from KV without
restarting it, and the agents refuse commands stamped with the dead leader's epoch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import nats
import pytest
from cli_harness import Ctl, eventually

from coordinator.auth import creds_path
from coordinator.ctl.home import pid_file
from proto import subjects
from proto.codec import encode, reply_decoder
from proto.commands import ReservePort
from ringmaster.auth import connect_options
from ringmaster.procs import read_pid

pytestmark = pytest.mark.slow


async def stale_command(url: str, creds: Path, epoch: int) -> tuple[bool, str]:
    """The deposed leader's command, sent with its own (still valid) creds."""
    nc = await nats.connect(url, **connect_options(creds))
    msg = await nc.request(subjects.command("local", "node-0"), encode(ReservePort(epoch=epoch)), 5)
    await nc.close()
    reply = reply_decoder.decode(msg.data)
    return reply.ok, reply.error


@pytest.mark.timeout(400)
def test_standby_takes_over_mid_job_without_a_restart(ctl: Ctl, tmp_path: Path) -> None:
    ctl("up", "--nodes", "2", "--standby")
    job = ctl.start("tiny.toml", f"checkpoint.dir={tmp_path / 'ckpt'}")
    ctl.wait(job, lambda s: s["step"] >= 20)
    [first] = ctl.events("--kind", "coordinator.leader")
    old = first["coordinator"]
    killed = time.time()
    leader_pid = read_pid(pid_file(ctl.home, old))
    assert leader_pid is not None, f"no PID file for {old}"
    os.kill(leader_pid, signal.SIGKILL)

    def two_leaders() -> list[dict[str, Any]] | None:
        leaders = ctl.events("--kind", "coordinator.leader")
        return leaders if len(leaders) >= 2 else None

    new = eventually(two_leaders, 30, lambda: "no new leader", 0.1)[-1]
    assert new["coordinator"] != old and new["epoch"] > first["epoch"]
    took = datetime.fromisoformat(new["time"]).timestamp() - killed
    assert took < 4.0, f"takeover took {took:.2f} s"
    final = ctl.wait(job, lambda s: s["state"] == "completed")
    assert final["restarts"] == 0 and final["step"] == final["target_steps"]
    url = json.loads((ctl.home / "cluster.json").read_text())["nats"]
    ok, error = asyncio.run(stale_command(url, creds_path(ctl.home, old), first["epoch"]))
    assert not ok and "stale epoch" in error
    refused = ctl.events("--kind", "command.refused")
    assert refused and refused[-1]["epoch"] == first["epoch"]
