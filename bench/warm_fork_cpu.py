"""The CPU a warm spare costs when forked from the node's template versus exec'd on its own,
and what its rank then spends from ``STARTED`` to its first step, measured in one run on
this machine (not a test).

    .venv/bin/python bench/warm_fork_cpu.py [--spares 10] [--ranks 2]

Both kinds go through the agent's own pool (``nodeagent.warm_pool.WarmPool``, the real
``python -m trainer.warm``): exec'd is the pool told its template may not fork (as when
one has threads), so each spare imports for itself, as every spare did before templates.
A spare's CPU is its process's utime+stime (``/proc/<pid>/stat``, clock ticks) once it
has said ``READY``, plus, for a fork, what the template spent while the forks were made
(the ``fork`` itself copies its page tables). A rank's is the same counter read when the
pool returns it (``STARTED``) and when its log first shows a step (a 1-rank DeepSpeed
ZeRO-1 job, float8 emulated, on ``OMP_NUM_THREADS=1``): what the hand-over left to do,
and the writes to pages shared with the template (copy on write) for a fork. The wall
time from the launch to ``STARTED`` is the pool's ``take``, for a ready spare and, once,
for a launch that finds none ready (the template forks one for it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nodeagent.warm_pool import WarmPool  # noqa: E402
from proto.job import JobSpec  # noqa: E402
from proto.warm import WarmLaunch  # noqa: E402
from ringmaster.procs import wait_until_async  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
SPEC: dict[str, dict[str, Any]] = {
    "job": {"name": "bench"},
    "train": {
        "engine": "deepspeed",
        "model": "tiny",
        "steps": 2,
        "precision": "fp8",
        "fp8_recipe": "tensorwise",
        "micro_batch_size": 4,
        "seq_len": 128,
    },
    "checkpoint": {"every_steps": 1000, "dir": "ckpt", "keep": 1},
}


def cpu_s(pid: int) -> float:
    """utime+stime of ``pid`` (every thread's, living and gone) in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def run_s(pid: int) -> float:
    """The time ``pid``'s living threads have run (``schedstat``, nanoseconds): finer than
    :func:`cpu_s`'s clock ticks for what takes milliseconds."""
    tasks = Path(f"/proc/{pid}/task")
    return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks.iterdir()) / 1e9


async def until(predicate: Callable[[], object], timeout: float = 120.0) -> None:
    async def holds() -> bool:
        return bool(predicate())

    await wait_until_async(holds, timeout, 0.005)


async def spares(pool: WarmPool, count: int) -> tuple[list[float], list[float], float]:
    """The CPU of ``count`` more spares at READY (ticks, and schedstat's), and the
    template's share of each (schedstat's)."""
    pool.resize(1)
    await until(lambda: pool.ready() == 1)
    template = pool.templates.current
    before = run_s(template.pid) if template is not None else 0.0
    pool.resize(count + 1)
    await until(lambda: pool.ready() == count + 1)
    share = (run_s(template.pid) - before) / count if template is not None else 0.0
    fresh = pool.spares[1:]
    return [cpu_s(s.pid) for s in fresh], [run_s(s.pid) for s in fresh], share


async def rank(pool: WarmPool, work: Path, n: int, *, spare: bool = True) -> tuple[float, float]:
    """One rank through the pool: launch to STARTED (wall s), STARTED to first step (CPU s).
    ``spare``: wait for a ready spare first (else the launch finds none: a fork for it)."""
    fresh = {**SPEC, "checkpoint": {**SPEC["checkpoint"], "dir": f"ckpt-{n}"}}  # no resume
    spec = msgspec.convert(fresh, JobSpec)
    spec_path = work / f"spec-{n}.json"
    spec_path.write_bytes(msgspec.json.encode(spec))
    log = work / f"rank-{n}.log"
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29700 + n),
        "RINGMASTER_JOB_SPEC": str(spec_path),
        "RINGMASTER_JOB_ID": f"bench-{os.getpid()}-{n}",
        "RINGMASTER_WORKDIR": str(work),
    }
    if spare:
        await until(lambda: pool.ready() >= 1)
    launch = WarmLaunch(env=env, cwd=str(work), log=str(log))
    began = time.monotonic()
    proc = await pool.take(launch, job="bench", exit_record=work / f"rank-{n}.exit")
    handed = time.monotonic() - began
    assert proc is not None, "the pool started no warm rank"
    at_start = cpu_s(proc.pid)
    await until(lambda: "event=step " in log.read_text(errors="replace"))
    at_step = cpu_s(proc.pid)
    await proc.wait()
    return handed, at_step - at_start


async def measure(forks: bool, count: int, ranks: int, root: Path) -> dict[str, list[float]]:
    run_dir = root / ("forked" if forks else "exec")
    pool = WarmPool(0, run_dir)
    pool.templates.forks = forks
    pool.imports_at_once = 1
    try:
        seen, ran, share = await spares(pool, count)
        rows = [await rank(pool, run_dir, n) for n in range(ranks)]
        for idle in pool.spares if forks else []:
            os.kill(idle.pid, signal.SIGKILL)  # the next launch finds none ready
        await until(lambda: pool.ready() == 0)
        on_demand = [(await rank(pool, run_dir, ranks, spare=False))[0]] if forks else []
    finally:
        await pool.close()
        if os.environ.get("KEEP"):
            print("kept", run_dir)
    return {
        "spare_cpu_s": seen,
        "spare_run_s": ran,
        "template_share_s": [share],
        "handover_wall_s": [h for h, _ in rows],
        "start_to_step_cpu_s": [c for _, c in rows],
        "on_demand_wall_s": on_demand,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forks", type=int, default=10, help="forked spares to measure")
    parser.add_argument("--execs", type=int, default=3, help="exec'd spares to measure")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="warm-fork-"))
    try:
        results = {
            kind: asyncio.run(measure(kind == "forked", count, args.ranks, root))
            for kind, count in (("exec", args.execs), ("forked", args.forks))
        }
    finally:
        if not os.environ.get("KEEP"):
            shutil.rmtree(root, ignore_errors=True)
    print(
        "| spare | CPU to READY (s): stat, schedstat (medians) | template's CPU per fork (ms) "
        "| launch → STARTED (ms) | STARTED → first step, CPU (s) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for kind, r in results.items():
        ready = statistics.median(r["spare_cpu_s"])
        ran = statistics.median(r["spare_run_s"])
        walls = ", ".join(f"{1000 * w:.1f}" for w in r["handover_wall_s"])
        steps = ", ".join(f"{c:.2f}" for c in r["start_to_step_cpu_s"])
        print(
            f"| {kind} ({len(r['spare_cpu_s'])}) | {ready:.2f}, {ran:.4f} "
            f"| {1000 * r['template_share_s'][0]:.1f} | {walls} | {steps} |"
        )
    for wall in results["forked"]["on_demand_wall_s"]:
        print(f"\nno spare ready, one forked for the launch: launch → STARTED {1000 * wall:.1f} ms")


if __name__ == "__main__":
    main()
