"""Slurm's warning that an allocation ends, to a durable checkpoint, and its requeue to the
first step of the next allocation: Ringmaster's path beside Lightning's own auto-requeue.

    sudo .venv/bin/python bench/slurm_requeue.py [--repeats 2] [--time-limit] [--json OUT.json]

A real Slurm of three nodes (tests/e2e/slurm_cluster.py: ``munged``, ``slurmctld``, a
``slurmd`` per node in the node's network namespace, its hostname the node's id;
``cred_expire=5``, so Slurm's own delay before a requeued job may start is 6 s instead of
the default 121 s; ``sched_interval=1``).

- Ringmaster: ``coordinatorctl up --netns --nodes 3``; ``sbatch --nodes=3 --requeue`` of a script
  that runs ``exec coordinatorctl start --wait examples/tiny.toml`` (2 nodes train, 1 is the
  spare; a periodic checkpoint only every 1000 steps). Once it has trained 30 steps,
  ``scancel --signal=USR1 --batch``.
- Lightning: ``sbatch --nodes=1 --ntasks=1 --requeue`` of ``bench/slurm_lightning.py``
  (examples/lightning_module.py's model, ``SLURMEnvironment(auto_requeue=True)``, no
  Ringmaster; the same namespaces, no agents in them), one process on the CPU. Once it
  has trained 30 steps, the same signal.

- ``--time-limit``, once: Ringmaster's job submitted with ``--time=2 --signal=B:USR1@90``
  and no ``scancel``: Slurm's own warning, due 30 s after it starts the job (Slurm sends
  it from a periodic check, so up to about a minute later); its times count from Slurm's
  start of the job.

Timed from the moment ``scancel`` returns: the durable checkpoint (Ringmaster: the
``job.checkpointed`` event; Lightning: its ``hpc_ckpt_*.ckpt`` on disk), the steps the
checkpoint lacks against the newest step the ranks had logged by then (steps lost), the
requeued job's start in Slurm (``StartTime``, whole seconds), and its first training step
(the ranks' own log lines). The cluster and Slurm are stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from slurm_cluster import Slurm, unavailable  # noqa: E402

from bench.cluster_harness import TINY, Ctl, read_records, wait_for  # noqa: E402
from coordinator.ctl import netns as ns  # noqa: E402

NODES = ["node-0", "node-1", "node-2"]
WARM_STEPS = 30


def slurm_start(s: Slurm, job_id: str, restarts: int) -> float | None:
    """When Slurm started the ``restarts``-th run of ``job_id`` (None: not yet)."""
    fields = s.job(job_id)
    if int(fields.get("Restarts", "0")) != restarts or fields.get("JobState") != "RUNNING":
        return None
    return datetime.fromisoformat(fields["StartTime"]).timestamp()


@contextmanager
def slurm_on(net: ns.Netns | None, work: Path) -> Iterator[Slurm]:
    """Slurm on the namespaced nodes ``net``, stopped at the end."""
    s = Slurm(work / "slurm", NODES)
    try:
        s.start(net)
        yield s
    finally:
        s.stop()


def ringmaster_time_limit(work: Path) -> dict[str, Any]:
    return ringmaster(work, time_limit=True)


def ringmaster(work: Path, time_limit: bool = False) -> dict[str, Any]:
    ctl = Ctl(work / "cluster", work)
    ctl.env["SLURM_CONF"] = str(work / "slurm" / "slurm.conf")
    ctl("up", "--netns", "--nodes", "3")
    try:
        with slurm_on(ns.read(ctl.home), work) as s:
            return ringmaster_run(ctl, s, work, time_limit)
    finally:
        ctl("down", check=False)


def ringmaster_run(ctl: Ctl, s: Slurm, work: Path, time_limit: bool) -> dict[str, Any]:
    script = work / "train.sbatch"
    sets = "--set train.steps=100000 --set checkpoint.every_steps=1000"
    sets += f" --set checkpoint.dir={work / 'ckpt'}"
    script.write_text(
        f"#!/bin/bash\nexport RINGMASTER_HOME={ctl.home}\n"
        f"exec {' '.join(ctl.argv('start', '--wait', str(TINY)))} {sets}\n"
    )
    out = f"--output={work / 'batch.out'}"
    # with --time-limit: Slurm's own warning, USR1 90 s before a 2-minute limit
    limit = ["--time=2", "--signal=B:USR1@90"] if time_limit else []
    slurm_job = s("sbatch", "--parsable", "--nodes=3", "--requeue", "--open-mode=append",
                  *limit, out, f"--chdir={work}", str(script)).strip()  # fmt: skip

    def job_of(run: int) -> dict[str, Any] | None:
        for job in ctl.status()["jobs"]:
            if (job.get("allocation") or {}).get("restarts") == run:
                return dict(job)
        return None

    # with a time limit, Slurm's warning may come before WARM_STEPS: any training will do
    warm = 1 if time_limit else WARM_STEPS
    first = wait_for(lambda: (j := job_of(0)) and j["step"] >= warm and j, 300, 0.5)
    assert first, "the job never trained"
    if time_limit:  # times from Slurm's start of the job: its USR1 is due 30 s later
        signalled = slurm_start(s, slurm_job, 0) or time.time()
    else:
        s("scancel", "--signal=USR1", "--batch", slurm_job)
        signalled = time.time()
    stopped = wait_for(lambda: (j := job_of(0)) and j["state"] == "stopped" and j, 180, 0.2)
    assert stopped, "the job did not stop"
    said = ctl("tail", "--no-follow", "--json", "--job", first["id"])
    events = [json.loads(line) for line in said.splitlines() if line.strip()]
    saved = [e for e in events if e["kind"] == "job.checkpointed"][-1]
    logged = [r for r in read_records(ctl.logs(first["id"])) if r.event == "step"]
    newest = max(int(r.fields["step"]) for r in logged if r.wall <= signalled + 60)
    started = wait_for(lambda: slurm_start(s, slurm_job, 1), 180, 0.5)
    again = wait_for(lambda: (j := job_of(1)) and j["step"] and j, 300, 0.5)
    assert started and again, "the requeued job never trained"
    steps = [r for r in read_records(ctl.logs(again["id"])) if r.event == "step"]
    return {
        "checkpoint_s": datetime.fromisoformat(saved["time"]).timestamp() - signalled,
        "checkpoint_step": saved["step"],
        "steps_lost": newest - saved["step"],
        "resumed_step": again["resume_step"],
        "requeued_start_s": started - signalled,
        "first_step_s": steps[0].wall - signalled,
        "first_step_after_start_s": steps[0].wall - started,
    }


def lightning(work: Path) -> dict[str, Any]:
    """Lightning in the same namespaces a Ringmaster cluster would use, none of its daemons."""
    where = work / "net"
    where.mkdir()
    net = ns.plan(where, NODES, ns.CTL_NET, ns.DATA_NET)
    ns.create(where, net)
    try:
        with slurm_on(net, work) as s:
            return lightning_run(s, work)
    finally:
        ns.remove(where)


def lightning_run(s: Slurm, work: Path) -> dict[str, Any]:
    steps = work / "steps.log"
    script = work / "pl.sbatch"
    script.write_text(
        f"#!/bin/bash\nexec {sys.executable} {REPO / 'bench' / 'slurm_lightning.py'} "
        f"--out {work / 'pl-out'} --steps-log {steps}\n"
    )
    slurm_job = s("sbatch", "--parsable", "--nodes=1", "--ntasks=1", "--requeue",
                  "--job-name=pl-bench", "--open-mode=append", f"--output={work / 'pl.out'}",
                  f"--chdir={work}", str(script)).strip()  # fmt: skip

    def lines() -> list[tuple[float, int, int]]:
        text = steps.read_text() if steps.exists() else ""
        rows = (line.split() for line in text.splitlines())
        return [(float(w), int(st), int(run)) for w, st, run in rows]

    trained = wait_for(lambda: len(lines()) >= WARM_STEPS or None, 300, 0.5)
    assert trained, "Lightning never trained"
    s("scancel", "--signal=USR1", "--batch", slurm_job)
    signalled = time.time()
    ckpt = wait_for(lambda: next(iter((work / "pl-out").glob("hpc_ckpt_*.ckpt")), None), 60, 0.05)
    assert ckpt, "no hpc checkpoint"
    saved_at = ckpt.stat().st_mtime
    started = wait_for(lambda: slurm_start(s, slurm_job, 1), 180, 0.5)
    again = wait_for(lambda: [x for x in lines() if x[2] >= 1] or None, 300, 0.5)
    assert started and again, "the requeued run never trained"
    before = [x for x in lines() if x[2] == 0]
    resumed = again[0][1] - 1  # the step its checkpoint held
    s("scancel", slurm_job)
    gone = wait_for(
        lambda: s.job(slurm_job).get("JobState") not in ("RUNNING", "COMPLETING") or None, 60, 0.5
    )
    assert gone, "the Lightning run outlived its scancel"
    return {
        "checkpoint_s": saved_at - signalled,
        "checkpoint_step": resumed,
        "steps_lost": max(x[1] for x in before) - resumed,
        "resumed_step": resumed,
        "requeued_start_s": started - signalled,
        "first_step_s": again[0][0] - signalled,
        "first_step_after_start_s": again[0][0] - started,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--time-limit",
        action="store_true",
        help="also once: Ringmaster under a 2-minute --time with --signal=B:USR1@90",
    )
    args = p.parse_args()
    if why := unavailable():
        print(f"slurm_requeue: {why}", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {"ringmaster": [], "lightning": []}
    plan = [("ringmaster", ringmaster), ("lightning", lightning)] * args.repeats
    if args.time_limit:
        runs["ringmaster_time_limit"] = []
        plan.append(("ringmaster_time_limit", ringmaster_time_limit))
    for name, bench in plan:
        with tempfile.TemporaryDirectory(prefix=f"rm-slurm-{name}-") as tmp:
            result = bench(Path(tmp))
        runs[name].append(result)
        print(f"{name} #{len(runs[name])}: {json.dumps(result)}", flush=True)
    for name, results in runs.items():
        if not results:
            continue
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        print(f"{name} median: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
