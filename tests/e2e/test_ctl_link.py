"""A job node's control link down on ``up --netns``: its agent is off the bus, so the
node is away to the coordinator, but the ranks' collectives cross ``data0`` and they
train on. No restart and no ``node.lost``, whichever node it is: rank 0's (whose word the
silent agent relays) or the other."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cli_harness import Ctl, eventually, netns_unavailable

from coordinator.ctl.home import agent_run_dirs
from ringmaster.rank.log import read

WHY = netns_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(WHY), reason=WHY)]


def steps_logged(ctl: Ctl, job: str, after: float) -> list[int]:
    """The steps the job's ranks logged after ``after`` (Unix time), from their own logs."""
    lines = (r for d in agent_run_dirs(ctl.home) for r in read_rank_logs(d / "jobs" / job))
    return sorted(
        {int(r["step"]) for r in lines if r["event"] == "step" and float(r["wall"]) > after}
    )


def read_rank_logs(jobdir: Path) -> list[dict[str, str]]:
    return [r for log in sorted(jobdir.glob("rank-*.log")) for r in read(log.read_text())]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", [0, 1], ids=["rank-0-node", "other-node"])
def test_ctl_link_down_on_a_job_node_restarts_nothing(ctl: Ctl, tmp_path: Path, which: int) -> None:
    """A job node's agent off the bus for 20 s: the node is away to the coordinator (a
    warning), but its ranks' collectives cross data0 and they train on, which the
    coordinator tells from rank 0's word or, when that comes through the silent node,
    from the other node's beat; no restart, and the node is never declared lost. The
    agent comes back, the node is ready, nothing moved."""
    ctl("up", "--netns", "--nodes", "2")
    job = ctl.start("tiny.toml", "train.steps=100000", f"checkpoint.dir={tmp_path / 'ckpt'}")
    before = ctl.wait(job, lambda s: s["step"] >= 5)
    node = before["nodes"][which]
    ctl("inject", node, "link-down=ctl")
    down_at = time.time()

    def state() -> str:
        return str(next(n["state"] for n in ctl.view(None)["nodes"] if n["id"] == node))

    eventually(lambda: state() == "away", 30, lambda: f"{node} never away: {state()}", 0.5)
    time.sleep(max(0.0, 20 - (time.time() - down_at)))
    during = ctl.view(job)
    trained = steps_logged(ctl, job, down_at)
    assert during["restarts"] == 0 and during["state"] == "running", during
    assert len(trained) >= 10, trained  # steps kept coming while it was off the bus
    ctl("inject", node, "link-up=ctl")
    eventually(lambda: state() == "ready", 60, lambda: f"{node} stayed {state()}", 0.5)
    after = ctl.wait(job, lambda s: s["step"] >= trained[-1] + 5)
    assert after["restarts"] == 0 and after["nodes"] == before["nodes"], after
    [away] = ctl.events("--kind", "node.away")
    assert away["node"] == node and away["severity"] == "warning", away
    assert not ctl.events("--kind", "node.lost"), "an agent off the bus was called lost"
