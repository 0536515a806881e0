"""What one reconciliation pass costs the leader for one job as large as a cluster: the
job's expected ranks against its nodes' rank reports (``coordinator.reconcile``:
``job_findings`` and ``orphans``), as the leader runs them every tick (4 a second): a
full pass (every ``FULL_PASS_S``), and the passes in between, which look again only at
nodes whose reports changed (``Memo``), with none and with 1 % of the nodes changed.

    .venv/bin/python bench/reconcile_scale.py [--nodes 1000 5000 25000] [--gpus 8] [--repeat 5]

Each node reports its 8 live ranks of the job's current attempt, as a training job's
agents do; the pass finds nothing, which is the common case and the full cost (every rank
is looked at). Median of ``--repeat`` passes, in one process, on whatever else the
machine runs: compare sizes within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.reconcile import Memo, job_findings, orphans
from coordinator.registry import NodeInfo
from proto.job import JobRecord, JobSection, JobSpec, JobState
from proto.node import RankReport

TICKS_PER_S = 4  # the leader's job tick (coordinator.leader)


def cluster(n: int, gpus: int) -> tuple[JobRecord, dict[str, NodeInfo]]:
    job = JobRecord(
        id="big",
        name="big",
        spec=JobSpec(job=JobSection(name="big", nodes=n, gpus_per_node=gpus)),
        state=JobState.RUNNING,
        world_size=n * gpus,
        attempt=1,
        nodes=[f"node-{i:05d}" for i in range(n)],
    )
    nodes = {
        name: NodeInfo(
            id=name,
            ranks=tuple(
                RankReport(job="big", rank=i * gpus + g, attempt=1, pid=1000 + g, alive=True)
                for g in range(gpus)
            ),
        )
        for i, name in enumerate(job.nodes)
    }
    return job, nodes


def timed(fn: object, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        found = fn()  # type: ignore[operator]
        runs.append(time.perf_counter() - t)
        assert found == [], found
    return statistics.median(runs)


def memo_pass(job: JobRecord, nodes: dict[str, NodeInfo], changed: list[NodeInfo]) -> float:
    """One pass with the memo warm, after ``changed`` nodes' reports changed."""
    memo, orphan_memo = Memo(), Memo()
    job_findings(job, nodes, bool, memo)
    orphans({"big": job}, nodes, bool, orphan_memo)
    for node in changed:
        node.ranks_version += 1
    t = time.perf_counter()
    found = job_findings(job, nodes, bool, memo) + orphans({"big": job}, nodes, bool, orphan_memo)
    took = time.perf_counter() - t
    assert found == [], found
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000, 25000])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    print("| nodes | ranks | full pass | at 4 a second | pass, none changed | 1 % changed |")
    print("|---|---|---|---|---|---|")
    for n in args.nodes:
        job, nodes = cluster(n, args.gpus)
        full = timed(
            lambda job=job, nodes=nodes: (
                job_findings(job, nodes, bool) + orphans({"big": job}, nodes, bool)
            ),
            args.repeat,
        )
        some = list(nodes.values())[:: max(1, 100)]
        quiet = statistics.median(memo_pass(job, nodes, []) for _ in range(args.repeat))
        busy = statistics.median(memo_pass(job, nodes, some) for _ in range(args.repeat))
        print(
            f"| {n:,} | {n * args.gpus:,} | {full * 1e3:.1f} ms | {100 * full * TICKS_PER_S:.1f} % "
            f"| {quiet * 1e3:.1f} ms | {busy * 1e3:.1f} ms |"
        )


if __name__ == "__main__":
    main()
