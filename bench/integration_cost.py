"""What the Hugging Face integration costs a step: the same ``Trainer`` script with its
two-line callback and without, on the same two ranks, alternating, in one run.

    .venv/bin/python bench/integration_cost.py [--rounds 6] [--steps 300] [--warmup 30]
        [--memory on|off] [--model "--layers 6 --width 256"] [--blocks N] [--json OUT.json]

Each round runs the script without its integration lines, then with them
(``examples/hf_trainer.py``), each for ``--steps`` steps on two ranks of this machine
started as a node agent starts them (torchrun's environment, one intra-op thread, each
rank pinned to its share of the cores; with the callback also the
job spec, and a fake agent on the control socket that takes rank 0's progress as the real
one does, ``ringmaster/rank/fake_agent.py``). No cluster runs beside them: its daemons' own work
on these two cores would move step times by more than what is measured here, and a rank
pays only for what it does itself. Every step is timed the same way in both, by
``bench/hf_steps.py``'s stopwatch callback: the time between consecutive ``on_step_end``,
so it holds whatever the integration does there (the step's agreement, the beat, progress
out, memory snapshots, and their background work's share of the cores). Each run's figure
is rank 0's median step time after ``--warmup`` steps; the cost is the median of the
rounds' ratios, with callback over without. ``--memory off`` leaves the memory tier out
(``checkpoint.memory_tier = false``), to tell its share apart; ``--model`` passes the
script a larger GPT-2 (its ``--layers`` and ``--width``): the example's default (2 layers
of 64) steps in about 20 ms here, where any fixed cost of a step shows most.

Two runs of the same script on this machine differ by more than the cost sought (their
medians move by 10 % and more), so ``--blocks N`` measures inside one run instead: each
round is a single run of the script with its callback, whose step work is done only in
alternate blocks of ``N`` steps (``RINGMASTER_BENCH_BLOCKS``, ``bench/hf_steps.py``); the
round's ratio is the median step inside the blocks with it over the median inside the
blocks without (a block's first step, which straddles the change, counts in neither).
What this leaves out is only what the integration costs while no step is reported: its
threads' idle waits, and the start (``restore``), a one-time cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_harness import REPO, read_records
from bench.trainer_bench import free_port
from coordinator.rendezvous import cpu_slice
from ringmaster.memory_store import remove_job_ram
from ringmaster.rank.fake_agent import FakeAgent

SCRIPT = REPO / "examples" / "hf_trainer.py"
STOPWATCH = REPO / "bench" / "hf_steps.py"


def unmodified(into: Path) -> Path:
    lines = SCRIPT.read_text().splitlines()
    into.write_text("\n".join(x for x in lines if not x.rstrip().endswith("# ringmaster")))
    return into


def _pinned(rank: int) -> Callable[[], None]:
    """Each rank on its share of this machine's cores, as an agent pins a real node's
    ranks (``coordinator.rendezvous.cpu_slice``)."""
    cpus = cpu_slice(rank, 2, os.cpu_count() or 1)
    return lambda: os.sched_setaffinity(0, cpus) if cpus else None


Step = tuple[int, float, bool]  # step, seconds, whether the callback acted in its block


def run(root: Path, name: str, script: Path, args: argparse.Namespace, job: bool) -> list[Step]:
    """Two ranks of ``script`` to the end; rank 0's steps after the warm-up."""
    work = root / name
    work.mkdir(parents=True)
    port, procs, job_id = free_port(), [], f"cost-{root.name}-{name}"
    agent = FakeAgent(work / "agent.sock") if job else None
    memory = "true" if args.memory == "on" else "false"
    spec = work / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "job": {"name": "cost"},
                "checkpoint": {"dir": str(work / "ckpt"), "memory_tier": memory == "true"},
            }
        )
    )
    argv = [str(STOPWATCH), str(script), "--out", str(work / "out"), "--steps", str(args.steps)]
    argv += ["--save-steps", str(10 * args.steps), *args.model.split()]
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": str(REPO),
            "RINGMASTER_BENCH_WATCH": "watch",
            "OMP_NUM_THREADS": "1",  # as the rendezvous plan (and torchrun) sets it
            "RINGMASTER_BENCH_BLOCKS": str(args.blocks),
        }
        if agent is not None:
            env |= {
                "RINGMASTER_JOB_SPEC": str(spec),
                "RINGMASTER_JOB_ID": job_id,
                "RINGMASTER_WORKDIR": str(work),
                "RINGMASTER_CONTROL_SOCKET": str(agent.path),
                "RINGMASTER_ATTEMPT": "1",
            }
        with (work / f"rank-{rank}.log").open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    env=env,
                    cwd=work,
                    stdout=log,
                    stderr=log,
                    preexec_fn=_pinned(rank),
                )
            )
    codes = [p.wait(1800) for p in procs]
    if agent is not None:
        agent.close()
        remove_job_ram(job_id)
    if codes != [0, 0]:
        raise RuntimeError(f"{name}: ranks exited {codes}; see {work}")
    steps = [r for r in read_records([work / "rank-0.log"]) if r.event == "watch_step"]
    return [
        (int(r.fields["step"]), float(r.fields["step_s"]), r.fields.get("on") == "1")
        for r in steps
        if int(r.fields["step"]) > args.warmup
    ]


def median_step(steps: list[Step]) -> float:
    return statistics.median(seconds for _, seconds, _ in steps)


def in_blocks(steps: list[Step]) -> tuple[float, float]:
    """The median step inside blocks with the callback's work and inside blocks without,
    each block's first step left out."""
    kinds: dict[bool, list[float]] = {True: [], False: []}
    before: bool | None = None
    for _, seconds, on in steps:
        if on == before:
            kinds[on].append(seconds)
        before = on
    return statistics.median(kinds[False]), statistics.median(kinds[True])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--memory", choices=("on", "off"), default="on")
    parser.add_argument("--model", default="", help='the script\'s size: "--layers N --width W"')
    parser.add_argument(
        "--blocks", type=int, default=0, help="measure inside one run, in alternate blocks"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ringmaster-integration-cost-") as tmp:
        root = Path(tmp)
        plain = unmodified(root / "hf_plain.py")
        for i in range(args.rounds):
            if args.blocks:
                without, with_ = in_blocks(run(root, f"blocks-{i}", SCRIPT, args, job=True))
            else:
                without = median_step(run(root, f"plain-{i}", plain, args, job=False))
                with_ = median_step(run(root, f"callback-{i}", SCRIPT, args, job=True))
            rows.append((without, with_))
            print(
                f"round {i + 1}: {without:.5f} {with_:.5f} {with_ / without:.4f}", file=sys.stderr
            )
    print("| round | without (median s/step) | with | with / without |")
    print("|---|---|---|---|")
    for i, (a, b) in enumerate(rows, 1):
        print(f"| {i} | {a:.5f} | {b:.5f} | {b / a:.4f} |")
    ratios = [b / a for a, b in rows]
    print(
        f"\nmedian of the rounds' ratios {statistics.median(ratios):.4f} "
        f"(range {min(ratios):.4f}–{max(ratios):.4f}); medians of the runs "
        f"{statistics.median(b for _, b in rows):.5f} / {statistics.median(a for a, _ in rows):.5f}"
    )
    if args.json:
        out = {"rounds": rows, "memory": args.memory, "model": args.model, "blocks": args.blocks}
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
