"""A node's life in seconds: from a condition closing to the node admitted again, and from
an operator's drain to its job training on elsewhere.

    .venv/bin/python bench/node_life.py [--rounds 4] [--probation 10] [--json OUT.json]

``coordinatorctl up --nodes 4`` with NVMe read-only's probation cut to ``--probation``
seconds (``RINGMASTER_PROBATION``; its default is 300 s), one 2-rank ``examples/tiny.toml``
job (DDP, fp32) on two nodes, the other two free.

- closing → admitted, on the free nodes in turn (two faults each at most: a third within
  the hour would hold the node): ``inject NODE nvme-readonly=on``, the node drained,
  ``nvme-readonly=off``; the seconds from the agent's ``nvme.readonly`` closing event to
  the coordinator's ``node.returned`` (both event times), and what of it is not probation.
- drain → training, on the job's nodes in turn: ``drain NODE --reason bench``; the
  seconds from the command to the job's first step on its new nodes (the ranks' own log
  lines, ``wall=``), and the steps redone (0: it stopped at a checkpoint of its step);
  then ``undrain NODE``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_harness import TINY, Ctl, newest_step, read_records, recovered, wait_for


def events(ctl: Ctl, node: str, kind: str) -> list[dict[str, Any]]:
    out = ctl("tail", "--no-follow", "--json", "--node", node, "--kind", kind)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["time"]).timestamp()


def node_state(ctl: Ctl, node: str) -> str:
    return str(next(n["state"] for n in ctl.status()["nodes"] if n["id"] == node))


def closing_to_admitted(ctl: Ctl, node: str) -> float:
    seen = len(events(ctl, node, "node.returned"))
    ctl("inject", node, "nvme-readonly=on")
    if wait_for(lambda: node_state(ctl, node) == "draining", 30, 0.25) is None:
        raise RuntimeError(f"{node} was not drained")
    ctl("inject", node, "nvme-readonly=off")
    returned = wait_for(lambda: events(ctl, node, "node.returned")[seen:], 600, 0.5)
    if not returned:
        raise RuntimeError(f"{node} never returned")
    closed = [e for e in events(ctl, node, "nvme.readonly") if not e["readonly"]]
    return at(returned[0]) - at(closed[-1])


def drain_to_training(ctl: Ctl, job: str, node: str) -> tuple[float, int]:
    before = read_records(ctl.logs(job))
    drained_at = time.time()
    ctl("drain", node, "--reason", "bench")

    def back() -> tuple[float, float, int] | None:
        status = ctl.status(job)
        if node in status["nodes"] or status["state"] != "running":
            return None
        return recovered(read_records(ctl.logs(job)), drained_at)

    found = wait_for(back, 300, 0.5)
    if found is None:
        raise RuntimeError(f"{job} did not train on after {node} was drained")
    first_step, _, resumed = found
    redone = newest_step(before + read_records(ctl.logs(job)), drained_at) - resumed
    ctl("undrain", node)
    return first_step - drained_at, max(0, redone)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="measurements of each (default 4)")
    p.add_argument("--probation", type=float, default=10.0, help="s (default 10)")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rm-node-life-"))
    ctl = Ctl(work / "cluster", work)
    ctl.env.update(
        RINGMASTER_PROBATION=f"nvme.readonly={args.probation:g}", RINGMASTER_WARM_RANKS="0"
    )
    ctl("up", "--nodes", "4")
    try:
        sets = ["train.steps=1000000", "train.engine=ddp", "train.precision=fp32"]
        sets += ["checkpoint.every_steps=1000000", f"checkpoint.dir={work / 'ckpt'}"]
        job = ctl("start", str(TINY), *[a for s in sets for a in ("--set", s)]).strip()
        running = wait_for(lambda: (s := ctl.status(job))["step"] >= 5 and s, 300, 0.5)
        if not running:
            raise RuntimeError(f"{job} never trained")
        returned = []
        for i in range(args.rounds):
            free = sorted({"node-0", "node-1", "node-2", "node-3"} - set(ctl.status(job)["nodes"]))
            returned.append(closing_to_admitted(ctl, free[i % len(free)]))
        moved = []
        for _ in range(args.rounds):
            moved.append(drain_to_training(ctl, job, ctl.status(job)["nodes"][-1]))
    finally:
        ctl("down", check=False)
    figures = {
        "probation_s": args.probation,
        "closing_to_admitted_s": [round(s, 2) for s in returned],
        "drain_to_training_s": [round(s, 2) for s, _ in moved],
        "drain_steps_redone": [n for _, n in moved],
    }
    print(
        f"condition closing → node admitted again: median {statistics.median(returned):.2f} s "
        f"({args.probation:g} s of it probation; {', '.join(f'{s:.2f}' for s in returned)})"
    )
    took = [s for s, _ in moved]
    print(
        f"drain → its job training on elsewhere: median {statistics.median(took):.2f} s "
        f"({', '.join(f'{s:.2f}' for s in took)}); steps redone {[n for _, n in moved]}"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
