"""A rank's restart with and without the node agents' warm interpreters, in one run on this
machine (not a test).

    .venv/bin/python bench/restart_bench.py [--kills 5] [--rounds 1] [--settle 20]

Each round brings up a local 2-node cluster twice, pool off (``RINGMASTER_WARM_RANKS=0``,
every rank started cold) then on (the agents' default: one spare per simulated node), and
on each runs ``examples/tiny.toml`` (DeepSpeed ZeRO-1, world size 2, FP8 emulated) with
enough steps, killing the rank on ``node-1`` with SIGKILL ``--kills`` times, ``--settle``
seconds apart (and, with the pool, once every agent's spare is ready again). The time of a restart
runs from just before the kill to rank 0's first ``event=step`` line of the next attempt
(each rank logs its step line with its Unix time, ``wall=``, just before it reports the
step to its agent as ``StepDone``). The next attempt's phases come from rank 0's log:
``started`` (the worker's ``main`` runs: for a cold rank, after the interpreter and its
imports), ``process_group`` (joined), ``preflight_bandwidth`` (the 2-node link check),
``model_built``, ``model`` (engine ready), ``fresh_start``/``resumed_from`` (checkpoint
loaded) and the first ``step``. Whether each restarted rank ran warm is read from its log.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ringmaster.procs import wait_until  # noqa: E402
from ringmaster.rank.log import read  # noqa: E402
from ringmaster.rundir import JobDir, live_ranks  # noqa: E402

JOB = REPO / "examples" / "tiny.toml"
CTL = [sys.executable, "-m", "coordinator.ctl.main"]
PHASES = [
    ("started", "process ready"),
    ("process_group", "process group joined"),
    ("preflight_bandwidth", "preflight bandwidth done"),
    ("model_built", "model built"),
    ("model", "engine ready"),
    ("loaded", "checkpoint loaded"),
    ("step", "first step"),
]


def ctl(home: Path, *args: str, env: dict[str, str] | None = None) -> str:
    run = subprocess.run(
        [*CTL, args[0], "--dir", str(home), *args[1:]],
        capture_output=True,
        text=True,
        env=env,
    )
    if run.returncode != 0:
        raise SystemExit(f"coordinatorctl {' '.join(args)}: {run.stderr.strip()}")
    return run.stdout


def events(log: Path) -> list[tuple[float, str]]:
    return [(float(r["wall"]), r["event"]) for r in read(log.read_text(errors="replace"))]


def attempt_after(log: Path, since: float) -> dict[str, float] | None:
    """Rank 0's phases of the first attempt started after ``since``, once it has stepped;
    times in seconds after ``since``."""
    seen: dict[str, float] = {}
    for wall, event in events(log):
        if event == "started" and wall > since and "started" not in seen:
            seen["started"] = wall
        elif "started" in seen:
            key = "loaded" if event in ("fresh_start", "resumed_from") else event
            if key == "preflight_bandwidth" or key not in seen:
                seen[key] = wall  # the link check logs several lines: the last one counts
            if key == "step":
                return {k: v - since for k, v in seen.items()}
    return None


def warm_starts(log: Path, count: int) -> int:
    """How many of the last ``count`` starts in a rank's log ran in a warm interpreter."""
    lines = log.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if " event=started " in line + " "]
    return sum(
        1
        for i in starts[-count:]
        if i > 0 and lines[i - 1].startswith("trainer.warm: ") and "runs this rank" in lines[i - 1]
    )


def spares_ready(home: Path) -> bool:
    """Every agent's newest spare is ready (its log says so after its last warm start)."""
    for log in (home / "logs").glob("nodeagent-node-*.log"):
        lines = log.read_text(errors="replace").splitlines()
        ready = [i for i, line in enumerate(lines) if "warm interpreter ready" in line]
        taken = [
            i for i, line in enumerate(lines) if "rank started" in line and "warm=True" in line
        ]
        if not ready or (taken and ready[-1] < taken[-1]):
            return False
    return True


def run_cluster(warm: bool, kills: int, settle: float) -> tuple[list[dict[str, float]], int]:
    home = Path(tempfile.mkdtemp(prefix="rm-restart-"))
    env = {**os.environ, "RINGMASTER_WARM_RANKS": "" if warm else "0"}
    env.pop("RINGMASTER_HOME", None)
    ctl(home, "up", "--nodes", "2", env=env)
    trials: list[dict[str, float]] = []
    try:
        job = ctl(
            home,
            "start",
            str(JOB),
            "--set",
            "train.steps=1000000",
            "--set",
            f"checkpoint.dir={home}/ckpt",
            "--set",
            "checkpoint.every_steps=25",
            "--set",
            f"policy.max_restarts={kills + 5}",
        ).strip()
        rank0 = JobDir(home / "nodes" / "node-0" / "agent", job).rank_log(0)
        node1 = home / "nodes" / "node-1" / "agent"
        for n in range(kills):
            time.sleep(settle)  # training, the same time with and without the pool
            if warm:  # and the spare taken by the last restart is back
                wait_until(lambda: spares_ready(home), 120, interval=0.2)
            [victim] = [r for r in live_ranks(node1) if r.job == job]
            killed = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            phases = wait_until(functools.partial(attempt_after, rank0, killed), 120, 0.05)
            trials.append(phases)
            print(
                f"{'warm' if warm else 'cold'} kill {n + 1}: {phases['step']:.2f} s to a step",
                flush=True,
            )
        ctl(home, "stop", job)
        count = warm_starts(rank0, kills) + warm_starts(JobDir(node1, job).rank_log(1), kills)
    except BaseException:
        print(f"kept {home} for inspection", file=sys.stderr)
        ctl(home, "down")
        raise
    ctl(home, "down")
    shutil.rmtree(home, ignore_errors=True)
    return trials, count


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--settle", type=float, default=20.0)
    args = p.parse_args()
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    warm_counts = {False: 0, True: 0}
    for _ in range(args.rounds):
        for warm in (False, True):
            trials, count = run_cluster(warm, args.kills, args.settle)
            results[warm] += trials
            warm_counts[warm] += count
    print()
    print("| pool | restarts | kill → first step (s), each | median | restarted ranks warm |")
    print("|---|---|---|---|---|")
    for warm in (False, True):
        each = [t["step"] for t in results[warm]]
        print(
            f"| {'on' if warm else 'off'} | {len(each)} | {', '.join(f'{x:.2f}' for x in each)} "
            f"| **{statistics.median(each):.2f} s** | {warm_counts[warm]} of {2 * len(each)} |"
        )
    cold = statistics.median(t["step"] for t in results[False])
    hot = statistics.median(t["step"] for t in results[True])
    print(f"\nratio warm ÷ cold: **{hot / cold:.2f}**\n")
    print("| phase (rank 0 of the next attempt), median s after the kill | pool off | pool on |")
    print("|---|---|---|")
    for key, name in PHASES:
        row = []
        for warm in (False, True):
            values = [t[key] for t in results[warm] if key in t]
            row.append(f"{statistics.median(values):.2f}" if values else "–")
        print(f"| {name} (`{key}`) | {row[0]} | {row[1]} |")


if __name__ == "__main__":
    main()
