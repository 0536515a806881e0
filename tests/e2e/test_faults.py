"""Faults an operator can rehearse, one after another on one job of a 4-node cluster, each
costing exactly one restart: the rendezvous master's machine dies (agent and ranks at
once), a rank freezes (SIGSTOP: found as hung, the culprit named with its stacks), and a
spot notice (the ranks checkpoint at the next step and the job resumes from exactly
there). The job goes on on the nodes left; its goodput ledger, bucket by bucket, agrees
with what its ranks' own step timestamps say within 1 % of the job's wall time."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_harness import Ctl, eventually, restarted
from ledger_truth import attempts, check_ledger, truth

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_machine_loss_hang_and_notice_each_cost_one_restart(ctl: Ctl, tmp_path: Path) -> None:
    ctl("up", "--nodes", "4")
    job = ctl.start(
        "tiny.toml",
        "train.steps=100000",
        "checkpoint.every_steps=100",
        "job.min_nodes=1",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    ctl.wait(job, lambda s: s["state"] == "running" and s["step"] >= 20)
    ctl("pause", job)
    ctl.wait(job, lambda s: s["state"] == "paused")
    ctl("resume", job)
    status = ctl.wait(job, lambda s: s["state"] == "running" and s["step"] >= 40)
    master = status["nodes"][0]
    ctl("inject", master, "lose-node")
    first = restarted(ctl, job, 1)
    assert master not in first["nodes"] and len(first["nodes"]) == 2

    status = ctl.wait(job, lambda s: s["state"] == "running" and s["restarts"] == 1)
    victim = status["nodes"][1]
    ctl("inject", victim, "hang")
    # The stopped rank's node names it. The other node's rank waits in the step's
    # collective and, on a loaded machine, may be stalled twice its threshold before the
    # culprit's stacks are in: its agent may then say so too, but only as "culprit unknown".
    [hung] = eventually(
        lambda: (
            [
                e
                for e in ctl.events("--job", job)
                if e["kind"] == "worker.hung" and not e["culprit_unknown"]
            ]
            or None
        ),
        60,
        lambda: "no worker.hung naming a culprit",
        0.5,
    )
    assert hung["node"] == victim and hung["rank"] == 1 and "stopped" in hung["evidence"]
    assert hung["stacks"], "the culprit's stacks were not captured"
    restarted(ctl, job, 2)
    recovering = [e for e in ctl.events("--job", job) if e["kind"] == "job.recovering"]
    assert f"on {victim} hung" in recovering[1]["reason"], recovering[1]
    others = [e for e in ctl.events("--job", job) if e["kind"] == "worker.hung" and e != hung]
    assert all(e["culprit_unknown"] and e["node"] != victim for e in others), others

    status = ctl.wait(job, lambda s: s["state"] == "running" and s["restarts"] == 2)
    noticed = status["nodes"][0]
    ctl("inject", noticed, "spot-notice=20")
    third = restarted(ctl, job, 3)
    assert noticed not in third["nodes"]
    # the machine lost at the start was paged once, as lost (its job restarted without it)
    [lost] = eventually(
        lambda: [e for e in ctl.events("--kind", "node.lost") if e["node"] == master] or None,
        60,
        lambda: f"{master} never declared lost: {ctl.events('--node', master)}",
        0.5,
    )
    assert lost["severity"] == "critical", lost
    events = ctl.events("--job", job)
    [recovering] = [e for e in events if e["kind"] == "job.recovering"][2:3]
    assert "preemption" in recovering["reason"]
    # the ranks checkpointed at the step where they stopped, after the notice, and the
    # next attempt starts there: nothing is redone (the next attempt's own checkpoints,
    # which a warm restart may reach before these events are read, come after it)
    stopped_at = [
        e["step"]
        for e in events
        if e["kind"] == "job.checkpointed" and recovering["time"] < e["time"] <= third["time"]
    ]
    assert stopped_at and third["from_step"] == stopped_at[-1]

    ctl.wait(job, lambda s: s["state"] == "running" and s["restarts"] == 3)
    ctl("stop", job)
    final = ctl.wait(job, lambda s: s["state"] == "stopped")
    assert final["restarts"] == 3  # one per fault
    assert not [e for e in ctl.events("--job", job) if e["kind"] == "job.failed"]

    # the ledger against the ranks' own account
    runs = attempts(ctl.home, job)
    check_ledger(final, runs, ctl.events("--job", job))
    ranks = truth(runs, final["started_at"])
    assert ranks["paused"] > 0 and ranks["recovery"] > 0 and ranks["checkpoint_stall"] > 0


@pytest.mark.shared_cluster(nodes=2)
@pytest.mark.timeout(400)
def test_a_non_finite_loss_rewinds_and_a_slow_node_is_a_straggler(ctl: Ctl, tmp_path: Path) -> None:
    ctl("up", "--nodes", "2")
    job = ctl.start(
        "tiny.toml",
        "train.steps=100000",
        "checkpoint.every_steps=20",
        "policy.straggler_window_steps=10",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    ctl.wait(job, lambda s: (s["last_checkpoint_step"] or 0) >= 20)
    ctl("inject", "node-1", "nan-loss")
    [rewound] = eventually(
        lambda: [e for e in ctl.events("--job", job) if e["kind"] == "job.rewound"] or None,
        60,
        lambda: "no job.rewound",
        0.5,
    )
    assert rewound["to_step"] % 20 == 0 and rewound["from_step"] > rewound["to_step"]
    assert rewound["skip_to"] > rewound["skip_from"] and rewound["rewinds"] == 1
    status = ctl.wait(job, lambda s: s["step"] > rewound["from_step"])
    assert status["restarts"] == 0 and status["loss"] is not None  # in place, no restart

    ctl("inject", "node-1", "slow=4")
    [slow] = eventually(
        lambda: [e for e in ctl.events("--job", job) if e["kind"] == "worker.straggler"] or None,
        90,
        lambda: "no worker.straggler",
        0.5,
    )
    assert slow["node"] == "node-1" and slow["rank"] == 1 and slow["ratio"] > 1.5
    ctl("inject", "node-1", "clear")
    ctl("stop", job)
    assert ctl.wait(job, lambda s: s["state"] == "stopped")["rewinds"] == 1
