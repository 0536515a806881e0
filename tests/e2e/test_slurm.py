"""Inside a Slurm allocation, against a real Slurm (tests/e2e/slurm_cluster.py): the
cluster is ``up --netns``, and each node's ``slurmd`` runs in that node's network
namespace under the node's id as its hostname, beside its agent.

With ``nodeagent --health-gate`` as Slurm's ``Prolog``, a node with an open warning
refuses a job Slurm placed there, and the job runs on another node. An ``sbatch -N 3``
script then runs ``exec coordinatorctl start --wait``: the job trains on two
of the allocation's nodes and holds the third as its spare. An NVMe turning read-only on a
job node drains it in Slurm with Ringmaster's reason, and the job goes on on the spare;
once the device is writable again the node is on probation, still drained in Slurm, and
the drain is lifted as Ringmaster returns it, while the drain an administrator set on
another node meanwhile stays, shown beside that node in ``status``. Slurm's ``USR1`` to
the batch step stops the job at a step every rank agrees on, with a checkpoint there
(0 steps lost); ``start`` requeues the Slurm job and exits 75, and the requeued script's
job resumes from that step, training on the returned node. Preempted by a job of a higher
partition (``PreemptMode=REQUEUE``, ``GraceTime``), Slurm's ``SIGTERM`` stops it the same
way, Slurm requeues it itself, and the next run resumes there. Its time limit cut short,
Slurm's warning before it (``--signal=B:USR1@100``) stops it the same way. ``scancel``
cancels it: the job stops at its checkpoint and nothing is requeued.

Inside a 2-node allocation: an operator's drain of the node outside it shows in Slurm as
``ringmaster: operator: …`` until ``undrain``; an agent restarted by its supervisor, then
the bus frozen for 30 s, drain nothing and restart nothing; a machine that dies (agent, ranks,
``slurmd``) is drained in Slurm as lost, the job, with no spare left, stops to be
requeued, and the requeued job runs without that node; a batch step killed outright
stops its job.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cli_harness import EXAMPLES, Ctl, eventually
from slurm_cluster import Slurm, slurm

from coordinator.ctl import netns as ns
from coordinator.ctl.home import pid_file
from ringmaster.checkpoints import newest_sealed
from ringmaster.procs import read_pid
from ringmaster.slurm import REQUEUE_EXIT

pytestmark = pytest.mark.slow
NODES = ["node-0", "node-1", "node-2"]
BUS_FREEZE_S = 30.0  # twice the away grace: only the bus' own canary tells it from losses
PROBATION_S = 10.0  # NVMe read-only's, cut from its default for the scenario


@pytest.fixture
def slurm_cluster(tmp_path: Path, ctl: Ctl) -> Any:
    """Slurm for the cluster of ``ctl``, stopped before that cluster goes down (its
    namespaces with it)."""
    with slurm(tmp_path / "slurm", NODES) as cluster:
        yield cluster


def drains(s: Slurm) -> dict[str, str]:
    return {name: node.reason for name, node in s.nodes().items() if node.drained}


def node_state(ctl: Ctl, node: str) -> str:
    return str(node_record(ctl, node)["state"])


def node_record(ctl: Ctl, node: str) -> dict[str, Any]:
    return next(dict(n) for n in ctl.view(None)["nodes"] if n["id"] == node)


def batch_script(ctl: Ctl, tmp_path: Path, every: int = 1000) -> Path:
    """``exec coordinatorctl start --wait`` of a long tiny job, a periodic checkpoint
    every ``every`` steps."""
    script = tmp_path / "train.sbatch"
    sets = {
        "job.name": "in-slurm",
        "train.steps": "100000",
        "checkpoint.dir": str(tmp_path / "ckpt"),
        "checkpoint.every_steps": str(every),
    }
    args = " ".join(f"--set {k}={v}" for k, v in sets.items())
    script.write_text(
        "#!/bin/bash\n"
        f"export RINGMASTER_HOME={ctl.home}\n"
        f"exec {sys.executable} -m coordinator.ctl.main start --wait {EXAMPLES / 'tiny.toml'} "
        f"{args}\n"
    )
    return script


def ringmaster_job(ctl: Ctl, restarts: int) -> dict[str, Any]:
    """The job the batch script started in its ``restarts``-th run, once it trains."""

    def found() -> dict[str, Any] | None:
        for job in ctl.view(None)["jobs"]:
            alloc = job.get("allocation") or {}
            if alloc.get("restarts") == restarts and job["state"] == "running" and job["step"]:
                return dict(job)
        return None

    return eventually(found, 180, lambda: f"no job of run {restarts} training", 0.5)


@pytest.mark.timeout(600)
def test_a_job_in_an_allocation_drains_in_slurm_and_is_requeued_at_its_checkpoint(
    slurm_cluster: Slurm, ctl: Ctl, tmp_path: Path
) -> None:
    s = slurm_cluster
    ctl.env["SLURM_CONF"] = str(s.conf)  # the coordinators drain through this Slurm
    ctl.env["RINGMASTER_PROBATION"] = f"nvme.readonly={PROBATION_S:g}"
    ctl("up", "--netns", "--nodes", "3")  # a Slurm node and its agent share a namespace
    s.start(ns.read(ctl.home))

    # the health gate as Slurm's Prolog: a node with an open warning refuses the job
    # Slurm placed there (Slurm drains it, "Prolog error"), and the job runs elsewhere
    agent = f"{ctl.home}/nodes/$SLURMD_NODENAME"
    s.prolog(
        f"exec {sys.executable} -m nodeagent.cli --config {agent}/agent.toml "
        f"--run-dir {agent}/agent --metrics-port=-1 --health-gate"
    )
    ctl("inject", "node-1", "nvme-latency=500")
    eventually(lambda: node_state(ctl, "node-1") == "degraded", 30, lambda: "no spike", 0.5)
    probe = tmp_path / "probe.out"
    s(
        "sbatch", "--nodes=1", "--open-mode=append", f"--output={probe}",
        "--wrap", "echo ran on $SLURMD_NODENAME",
    )  # fmt: skip

    def ran() -> str | None:
        said = probe.read_text() if probe.exists() else ""
        return said if "ran on" in said else None

    said = eventually(ran, 90, lambda: "the job never ran", 0.5)
    # refused where it first landed (node-1 weighs least), it ran on another node
    assert "Error running slurm prolog" in said, said
    assert said.splitlines()[-1] in ("ran on node-0", "ran on node-2"), said
    assert drains(s).get("node-1", "").startswith("Prolog error"), drains(s)
    ctl("inject", "node-1", "clear")
    eventually(lambda: node_state(ctl, "node-1") == "ready", 30, lambda: "still spiking", 0.5)
    s("scontrol", "update", "NodeName=node-1", "State=RESUME")  # the administrator's call

    out = tmp_path / "batch.out"
    slurm_job = s(
        "sbatch", "--parsable", "--nodes=3", "--requeue", "--open-mode=append",
        "--signal=B:USR1@100", f"--output={out}", f"--chdir={tmp_path}",
        str(batch_script(ctl, tmp_path)),
    ).strip()  # fmt: skip

    # the job runs on the allocation's nodes, the one it does not use held as its spare
    job = ringmaster_job(ctl, 0)
    assert job["allocation"]["job_id"] == slurm_job and sorted(job["allocation"]["hosts"]) == NODES
    assert len(job["nodes"]) == 2 and set(job["nodes"]) | set(job["spare_nodes"]) == set(NODES)

    # a job node's NVMe turns read-only: drained in Slurm with our reason and evidence
    bad = job["nodes"][1]
    ctl("inject", bad, "nvme-readonly=on")
    reason = eventually(lambda: drains(s).get(bad), 60, lambda: f"{bad} not drained", 0.5)
    assert reason.startswith(f"ringmaster: nvme.readonly:{bad}:"), reason
    moved = ctl.wait(job["id"], lambda j: j["state"] == "running" and bad not in j["nodes"])
    assert len(moved["nodes"]) == 2

    # an administrator drains another node meanwhile, shown beside it; once the device is
    # writable again the node is on probation, still drained in Slurm, and ours is lifted
    # as Ringmaster returns it; theirs stays
    admin = moved["nodes"][0]
    s("scontrol", "update", f"NodeName={admin}", "State=DRAIN", "Reason=admin: fan check")
    shown = lambda: node_record(ctl, admin)["slurm_drain"] == "admin: fan check"  # noqa: E731
    eventually(shown, 30, lambda: f"{admin}: {node_record(ctl, admin)}", 0.5)
    ctl("inject", bad, "nvme-readonly=off")
    eventually(
        lambda: node_record(ctl, bad)["drain_reason"].startswith("probation after"),
        30,
        lambda: f"{bad} not on probation: {node_record(ctl, bad)}",
        0.25,
    )
    assert drains(s)[bad].startswith(f"ringmaster: nvme.readonly:{bad}:"), drains(s)
    eventually(lambda: bad not in drains(s), 60, lambda: f"{bad} still drained", 0.5)
    assert node_state(ctl, bad) == "ready" and drains(s) == {admin: "admin: fan check"}
    lifted = [e for e in ctl.events("--node", bad, "--kind", "node.slurm")]
    assert [e["action"] for e in lifted] == ["drained", "resumed"], lifted
    returned = [e for e in ctl.events("--node", bad, "--kind", "node.returned")]
    assert lifted[1]["time"] >= returned[-1]["time"], (lifted, returned)  # not before it
    s("scontrol", "update", f"NodeName={admin}", "State=RESUME")

    # Slurm's warning that the allocation ends: a checkpoint at an agreed step, 0 lost
    before = ctl.wait(job["id"], lambda j: j["state"] == "running")
    s("scancel", "--signal=USR1", "--batch", slurm_job)
    stopped = ctl.wait(job["id"], lambda j: j["state"] == "stopped")
    assert stopped["requeue"] and "USR1" in stopped["reason"], stopped
    saved = [e["step"] for e in ctl.events("--job", job["id"], "--kind", "job.checkpointed")]
    assert saved and saved[-1] == stopped["step"] >= before["step"], (saved, stopped)
    eventually(lambda: f"exit {REQUEUE_EXIT}" in out.read_text(), 30, lambda: out.read_text(), 0.5)
    assert f"requeued Slurm job {slurm_job}" in out.read_text()

    # the requeued script's job resumes from that checkpoint in its new allocation, on the
    # node Ringmaster returned
    again = ringmaster_job(ctl, 1)
    assert again["id"] != job["id"] and again["resume_step"] == stopped["step"], again
    assert bad in again["nodes"], again
    started = [e for e in ctl.events("--job", again["id"]) if e["kind"] == "job.started"]
    assert f"resuming from step {stopped['step']}" in started[0]["message"]
    assert s.job(slurm_job)["Restarts"] == "1"

    # preempted by a job of a higher partition: Slurm's SIGTERM (GraceTime before its
    # SIGKILL) stops the job at an agreed step with a checkpoint, and Slurm requeues it
    s("sbatch", "--partition=urgent", "--nodes=3", "--wrap", "sleep 1")
    preempted = ctl.wait(again["id"], lambda j: j["state"] == "stopped")
    assert preempted["requeue"] and "SIGTERM" in preempted["reason"], preempted
    saved = [e["step"] for e in ctl.events("--job", again["id"], "--kind", "job.checkpointed")]
    assert saved and saved[-1] == preempted["step"], (saved, preempted)
    third = ringmaster_job(ctl, 2)
    assert third["resume_step"] == preempted["step"], third
    assert f"Slurm job {slurm_job} already requeued by Slurm" in out.read_text()

    # a time limit: cut to 2 minutes, Slurm's warning 100 s before it (--signal, given at
    # submission) comes at its next pass, and stops the job at a checkpoint, 0 lost
    s("scontrol", "update", f"JobId={slurm_job}", "TimeLimit=2")
    timed = ctl.wait(third["id"], lambda j: j["state"] == "stopped", timeout=120)
    assert timed["requeue"] and "USR1" in timed["reason"], timed
    saved = [e["step"] for e in ctl.events("--job", third["id"], "--kind", "job.checkpointed")]
    assert saved and saved[-1] == timed["step"], (saved, timed)
    s("scontrol", "update", f"JobId={slurm_job}", "TimeLimit=UNLIMITED")  # for the next run
    fourth = ringmaster_job(ctl, 3)
    assert fourth["resume_step"] == timed["step"], fourth

    # the scheduler's cancel: the job stops at a checkpoint, and nothing is requeued
    s("scancel", slurm_job)
    cancelled = ctl.wait(fourth["id"], lambda j: j["state"] == "stopped")
    assert not cancelled["requeue"] and "cancel" in cancelled["reason"].lower(), cancelled
    saved = [e["step"] for e in ctl.events("--job", fourth["id"], "--kind", "job.checkpointed")]
    assert saved and saved[-1] == cancelled["step"], (saved, cancelled)
    said = f"Slurm job {slurm_job} cancelled: {fourth['id']} stopped"
    eventually(lambda: said in out.read_text(), 30, out.read_text, 0.5)
    # what Slurm's accounting says of the runs (sacct over the job completion log): the
    # run stopped to be requeued, the preempted one, the one warned of its time limit,
    # then the cancelled one, not requeued
    runs = ["PENDING", "PREEMPTED", "PENDING", "CANCELLED"]
    done = lambda: [state for state, _ in s.completions(slurm_job)]  # noqa: E731
    eventually(lambda: done() == runs, 30, done, 0.5)
    assert s.job(slurm_job)["Restarts"] == "3" and not [
        j for j in ctl.view(None)["jobs"] if (j.get("allocation") or {}).get("restarts") == 4
    ]


@pytest.mark.timeout(600)
def test_restarts_drain_nothing_and_a_node_lost_with_no_spare_is_requeued_without_it(
    slurm_cluster: Slurm, ctl: Ctl, tmp_path: Path
) -> None:
    s = slurm_cluster
    ctl.env["SLURM_CONF"] = str(s.conf)
    ctl("up", "--netns", "--nodes", "3")  # a Slurm node and its agent share a namespace
    s.start(ns.read(ctl.home))
    out = tmp_path / "batch.out"
    slurm_job = s(
        "sbatch", "--parsable", "--nodes=2", "--requeue", "--open-mode=append",
        f"--output={out}", f"--chdir={tmp_path}", str(batch_script(ctl, tmp_path, every=20)),
    ).strip()  # fmt: skip
    job = ringmaster_job(ctl, 0)
    assert job["spare_nodes"] == [] and len(job["nodes"]) == 2
    assert job["allocation"]["job_id"] == slurm_job

    # an operator's drain of the node outside the allocation shows in Slurm, until undrain
    [free] = [n for n in NODES if n not in job["allocation"]["hosts"]]
    ctl("drain", free, "--reason", "firmware update")
    reason = eventually(lambda: drains(s).get(free), 30, lambda: f"{free} not drained", 0.5)
    assert reason == "ringmaster: operator: firmware update", reason
    ctl("undrain", free)
    eventually(lambda: free not in drains(s), 30, lambda: f"{free} still drained", 0.5)

    # an agent killed and started again 1 s later (systemd's Restart=): its ranks train on;
    # no node.lost, no drain
    first, victim = job["nodes"]
    ctl("inject", first, "restart-agent")
    ctl.wait(job["id"], lambda j: j["step"] > job["step"] + 20)

    # then the bus itself frozen for 30 s (every node silent at once, Slurm still
    # answering): the ranks train on; nobody is lost or drained
    server = read_pid(pid_file(ctl.home, "nats-server"))
    assert server is not None
    os.kill(server, signal.SIGSTOP)
    try:
        time.sleep(BUS_FREEZE_S)  # the outage itself: nothing to wait for
    finally:
        os.kill(server, signal.SIGCONT)
    after = ctl.wait(job["id"], lambda j: j["step"] > job["step"] + 40)
    assert ctl.events("--kind", "node.lost") == [] and drains(s) == {}
    assert after["restarts"] == 0 and after["state"] == "running"

    # the machine of the other node dies (its agent, ranks and slurmd): found, drained in
    # Slurm with our reason; no spare in the allocation, so the job stops to be requeued
    ctl("inject", victim, "lose-node")
    s.kill(victim)
    reason = eventually(lambda: drains(s).get(victim), 60, lambda: f"{victim} not drained", 0.5)
    assert reason.startswith("ringmaster: node.lost: "), reason
    stopped = ctl.wait(job["id"], lambda j: j["state"] == "stopped", timeout=120)
    assert stopped["requeue"] and "cannot continue inside Slurm job" in stopped["reason"]
    # the newest checkpoint the ranks sealed (the record's may lag behind their reports on
    # a loaded bus), read before the requeued job can write more
    sealed = newest_sealed(tmp_path / "ckpt")
    assert sealed is not None and sealed.step >= (stopped["last_checkpoint_step"] or 0)
    eventually(lambda: f"exit {REQUEUE_EXIT}" in out.read_text(), 60, out.read_text, 0.5)

    # the requeued job gets an allocation without the drained node, and resumes
    again = ringmaster_job(ctl, 1)
    assert victim not in again["allocation"]["hosts"] and victim not in again["nodes"]
    assert again["resume_step"] == sealed.step, (again, sealed)

    # its batch step killed outright (no word to the job): the allocation is gone, and the
    # ranks, the agents' children, are stopped rather than left training on given-up nodes
    [batch] = [pid for pid in s.strays() if b"--wait" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(batch, signal.SIGKILL)
    ended = ctl.wait(again["id"], lambda j: j["state"] == "stopped", timeout=60)
    assert "its allocation is gone" in ended["reason"] and not ended["requeue"], ended
    runs = [("PENDING", "0:0"), ("FAILED", "0:9")]  # requeued; then killed by SIGKILL
    eventually(lambda: s.completions(slurm_job) == runs, 30, lambda: s.completions(slurm_job), 0.5)
