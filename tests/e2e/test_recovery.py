"""A rank dies mid-job: the coordinator stops the others, re-rendezvouses and resumes from
the newest durable checkpoint; later, ``down`` mid-job leaves no rank process alive."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_harness import Ctl

from ringmaster.procs import pid_alive

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_killed_rank_restarts_from_checkpoint_and_down_leaves_no_rank(
    ctl: Ctl, tmp_path: Path
) -> None:
    ctl("up", "--nodes", "2")
    job = ctl.start(
        "tiny.toml",
        "train.steps=80",
        "checkpoint.every_steps=20",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    before = ctl.wait(job, lambda s: (s["last_checkpoint_step"] or 0) >= 40)
    ctl("inject", "node-1", "kill-worker")
    final = ctl.wait(job, lambda s: s["state"] == "completed")
    assert final["restarts"] == 1 and final["step"] == 80
    events = ctl.events("--job", job)
    [restarted] = [e for e in events if e["kind"] == "job.restarted"]
    assert restarted["from_step"] >= before["last_checkpoint_step"]
    kinds = [e["kind"] for e in events]
    assert kinds.index("job.recovering") < kinds.index("job.restarted")
    assert final["goodput"]["recovery"] > 0

    second = ctl.start("tiny.toml", "train.steps=100000", f"checkpoint.dir={tmp_path / 'c2'}")
    ctl.wait(second, lambda s: s["step"] >= 3)
    pids = ctl.ranks(second)
    assert len(pids) == 2
    ctl("down")
    assert not [p for p in pids if pid_alive(p)], "down left training ranks running"
