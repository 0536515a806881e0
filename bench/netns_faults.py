"""Network faults on a namespaced local cluster, each timed from the fault to the job's
first step after it.

    sudo .venv/bin/python bench/netns_faults.py [--faults ctl,partition,data] [--repeats 1]
        [--json OUT.json]

``coordinatorctl up --netns`` with two nodes plus a spare for every round that leaves one
out, one 2-node ``examples/tiny.toml`` job (a checkpoint every 20 steps); then, for each
fault in ``--faults`` ``--repeats`` times, once the job has trained 20 steps since the last:

- ``ctl``: ``inject <the job's first node> link-down=ctl`` for ``--hold`` s (20), then
  ``link-up=ctl``. Its agent loses the bus, and with it rank 0's word to the coordinator;
  its ranks, whose collectives cross ``data0``, must train on: no restart. Also timed:
  its ``node.away`` (never a ``node.lost``), and the node ``ready`` again after.
- ``partition``: ``inject <first node> partition=<second node>`` (blackhole routes both
  ways on the data network): the job restarts without the second (an even split: the
  side away from rank 0's node goes). Also timed: the first ``net.peer`` on the first
  node, the first ``worker.hung`` and ``job.restarted``. ``clear`` lifts it afterwards.
- ``data``: ``inject <second node> link-down=data`` (the host side of its ``data0`` veth
  down: carrier lost). Also timed: the agent's ``net.link`` and ``job.restarted``. A
  drained node stays drained.
- ``loss``: ``inject <second node> netem=data:loss=<--loss>%`` for ``--hold`` s, then
  ``clear`` (on a kernel without the netem qdisc, an nftables rule drops that share of
  what the node sends). Its collectives slow every rank alike; the job must train on,
  with no restart and no ``worker.hung``. Also timed: the node's ``net.retrans``
  opening and closing, and the median seconds per step (rank 0's) while the loss held
  against as long before it and after ``clear``, the bench idle in all three.

Seconds run from the moment ``inject`` returns (the fault is its last act) to events'
own timestamps and to the first training step after the fault in the ranks' own logs
(``wall=`` Unix time): for a fault that restarts the job, the first step of the attempt
after it; ``null`` when none came within ``--cap``, and the next fault goes on. Then the
job is stopped and the cluster brought down; ``down`` must leave no namespace or link
behind.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_harness import (
    TINY,
    Ctl,
    Record,
    newest_step,
    read_records,
    recovered,
    wait_for,
)
from coordinator.ctl import netns as ns

FAULTS = ("ctl", "partition", "data", "loss")
SPARE = {"ctl": 0, "partition": 1, "data": 1, "loss": 0}  # nodes each round leaves out for good


@dataclass
class Round:
    fault: str  # as injected, node first
    to_first_step_s: float | None  # the first training step after it; None: not in --cap
    restarts: int  # the job's restarts it caused
    # seconds from the fault to the first event of each kind; and for ctl, the node ready
    # again after its link came back and the steps trained while it was down
    figures: dict[str, float]
    steps_redone: int
    nodes_after: list[str]


def first_event(ctl: Ctl, kind: str, after: float, *filters: str) -> float | None:
    """The Unix time of the first ``kind`` event after ``after``, if any yet."""
    out = ctl("tail", "--no-follow", "--json", "--since", "5m", "--kind", kind, *filters)
    times = [
        datetime.fromisoformat(json.loads(line)["time"]).timestamp()
        for line in out.split("\n")
        if line
    ]
    return next((t for t in times if t > after), None)


def since(ctl: Ctl, fault_at: float, kinds: Mapping[str, tuple[str, ...]]) -> dict[str, float]:
    """Seconds from the fault to the first event of each kind (filters alongside)."""
    found = {kind: first_event(ctl, kind, fault_at, *how) for kind, how in kinds.items()}
    return {kind: round(t - fault_at, 2) for kind, t in found.items() if t is not None}


def trained(ctl: Ctl, job: str, steps: int, cap: float) -> dict[str, Any]:
    """The job's status once it trained ``steps`` more steps."""
    begin = ctl.status(job)["step"]
    if wait_for(lambda: ctl.status(job)["step"] >= begin + steps, cap, 0.5) is None:
        raise RuntimeError(f"{job} did not train {steps} steps in {cap:.0f} s")
    return ctl.status(job)


def restarting_round(ctl: Ctl, job: str, cap: float, fault: str) -> Round:
    """``data`` or ``partition``: the job must restart without a node."""
    before = trained(ctl, job, 20, cap)
    first, second = before["nodes"]
    node, what = (
        (first, f"partition={second}") if fault == "partition" else (second, "link-down=data")
    )
    ctl("inject", node, what)
    fault_at = time.time()  # the fault is the last thing inject does
    back = wait_for(lambda: recovered(read_records(ctl.logs(job)), fault_at), cap, 0.2)
    kinds = {
        "net.peer": ("--node", first),
        "worker.hung": ("--job", job),
        "job.restarted": ("--job", job),
    }
    if fault == "data":
        kinds = {"net.link": ("--node", node), "job.restarted": ("--job", job)}
    events = since(ctl, fault_at, kinds)
    after = ctl.status(job)
    if fault == "partition":
        ctl("inject", node, "clear")  # both halves of the partition
    # None: the job did not recover within the cap (the round says so; the rest go on)
    step_at, started_at, resumed = back or (None, 0.0, 0)
    return Round(
        fault=f"{node} {what}",
        to_first_step_s=round(step_at - fault_at, 2) if step_at is not None else None,
        restarts=after["restarts"] - before["restarts"],
        figures=events,
        steps_redone=newest_step(read_records(ctl.logs(job)), started_at) - resumed if back else 0,
        nodes_after=after["nodes"],
    )


def ctl_round(ctl: Ctl, job: str, cap: float, hold: float) -> Round:
    """``ctl``: the first node (rank 0's, whose word its agent relays) off the bus for
    ``hold`` s; its ranks must train on."""
    before = trained(ctl, job, 20, cap)
    node = before["nodes"][0]
    ctl("inject", node, "link-down=ctl")
    fault_at = time.time()
    time.sleep(hold)
    ctl("inject", node, "link-up=ctl")
    up_at = time.time()

    def ready() -> bool:
        return any(n["id"] == node and n["state"] == "ready" for n in ctl.status()["nodes"])

    if wait_for(ready, cap, 0.5) is None:
        raise RuntimeError(f"{node} was not ready within {cap:.0f} s of its ctl0 coming back")
    back_at = time.time()
    steps = [r for r in read_records(ctl.logs(job)) if r.event == "step" and r.wall > fault_at]
    if not steps:
        raise RuntimeError(f"{job} made no step after {node} lost ctl0")
    after = ctl.status(job)
    events = since(ctl, fault_at, {"node.away": ("--node", node)})
    events["ready_after_link_up"] = round(back_at - up_at, 2)
    during = {int(r.fields["step"]) for r in steps if r.wall <= up_at}
    events["steps_while_down"] = float(len(during))
    return Round(
        fault=f"{node} link-down=ctl for {hold:g} s",
        to_first_step_s=round(steps[0].wall - fault_at, 2),
        restarts=after["restarts"] - before["restarts"],
        figures=events,
        steps_redone=0,
        nodes_after=after["nodes"],
    )


def step_seconds(records: list[Record], start: float, end: float) -> float | None:
    """The median seconds between rank 0's consecutive steps logged in [start, end]."""
    walls = [
        r.wall for r in records if r.event == "step" and r.rank == 0 and start <= r.wall <= end
    ]
    gaps = [b - a for a, b in itertools.pairwise(walls)]
    return round(statistics.median(gaps), 3) if gaps else None


def loss_round(ctl: Ctl, job: str, cap: float, hold: float, loss: float) -> Round:
    """``loss``: the second node loses ``loss`` % of what it sends on data0 for ``hold`` s;
    the job must train on through it. Step times are compared over three windows of
    ``hold`` s in which this bench sits still (each ``coordinatorctl`` it runs is a Python
    start that takes a core from training): before, during and after the loss."""
    before = trained(ctl, job, 20, cap)
    node = before["nodes"][1]
    quiet_at = time.time()
    time.sleep(hold)
    ctl("inject", node, f"netem=data:loss={loss:g}%")
    fault_at = time.time()
    time.sleep(hold)
    ctl("inject", node, "clear")
    cleared_at = time.time()
    time.sleep(hold)
    still_until = time.time()
    closed = wait_for(lambda: first_event(ctl, "net.retrans", cleared_at, "--node", node), cap, 1)
    after = ctl.status(job)
    records = read_records(ctl.logs(job))
    steps = [r for r in records if r.event == "step" and r.wall > fault_at]
    events = since(ctl, fault_at, {"net.retrans": ("--node", node)})
    if closed is not None:
        events["net.retrans_closed_after_clear"] = round(closed - cleared_at, 2)
    hung = first_event(ctl, "worker.hung", fault_at, "--job", job)
    events["worker_hung"] = 0.0 if hung is None or hung > cleared_at else round(hung - fault_at, 2)
    for name, (start, end) in {
        "step_s_before": (quiet_at, fault_at),
        "step_s_during": (fault_at, cleared_at),
        "step_s_after": (cleared_at, still_until),
    }.items():
        seconds = step_seconds(records, start, end)
        if seconds is not None:
            events[name] = seconds
    during = {int(r.fields["step"]) for r in steps if r.wall <= cleared_at}
    events["steps_during"] = float(len(during))
    return Round(
        fault=f"{node} netem=data:loss={loss:g}% for {hold:g} s",
        to_first_step_s=round(steps[0].wall - fault_at, 2) if steps else None,
        restarts=after["restarts"] - before["restarts"],
        figures=events,
        steps_redone=0,
        nodes_after=after["nodes"],
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, in order")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--hold", type=float, default=20.0, help="seconds ctl0 stays down, or loss holds"
    )
    p.add_argument("--loss", type=float, default=5.0, help="percent lost in the loss round")
    p.add_argument("--cap", type=float, default=120.0, help="seconds a round may take")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    faults = [f for f in args.faults.split(",") if f] * args.repeats
    if not faults or set(faults) - set(FAULTS):
        p.error(f"--faults: some of {', '.join(FAULTS)}")
    nodes = 2 + sum(SPARE[f] for f in faults)
    with tempfile.TemporaryDirectory(prefix="netns-bench-") as tmp:
        ctl = Ctl(Path(tmp) / "cluster", Path(tmp))
        ctl("up", "--netns", "--nodes", str(nodes))
        try:
            sets = ["train.steps=100000", "checkpoint.every_steps=20"]
            job = ctl("start", str(TINY), *(a for s in sets for a in ("--set", s))).strip()
            rounds = [
                ctl_round(ctl, job, args.cap, args.hold)
                if fault == "ctl"
                else loss_round(ctl, job, args.cap, args.hold, args.loss)
                if fault == "loss"
                else restarting_round(ctl, job, args.cap, fault)
                for fault in faults
            ]
            ctl("stop", job)
        finally:
            ctl("down")
        left = leftovers(ns.prefix(ctl.home))
    for r in rounds:
        print(json.dumps(asdict(r)))
    summary: dict[str, float | None] = {}
    for fault in dict.fromkeys(faults):
        times = [r.to_first_step_s for r, f in zip(rounds, faults, strict=True) if f == fault]
        done = [t for t in times if t is not None]
        summary[fault] = statistics.median(done) if len(done) == len(times) else None
        said = f"median {summary[fault]:.1f} s" if summary[fault] is not None else "none"
        print(f"==> {fault}: fault to the first step after: {said} (cap {args.cap:g} s)")
    if args.json:
        out = {"rounds": [asdict(r) for r in rounds], "median_to_first_step_s": summary}
        args.json.write_text(json.dumps(out, indent=2))
    if left:
        print(f"down left behind: {', '.join(left)}", file=sys.stderr)
        return 1
    return 0


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links whose names carry the cluster's prefix."""
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in spaces.splitlines()]
    names += [line.split(": ")[1].split("@")[0] for line in links.splitlines()]
    if shutil.which("nft"):  # the loss round's table
        nft = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        names += [line.split()[-1] for line in nft.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix)]


if __name__ == "__main__":
    sys.exit(main())
