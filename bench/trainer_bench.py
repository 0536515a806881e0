"""Trainer benchmarks on this machine's CPU (not a test): throughput and the cost of the
step-boundary control word (checkpoint stalls: ``bench/checkpoint_bench.py``).

    .venv/bin/python bench/trainer_bench.py [--steps 60] [--control-steps 400]

Throughput and control cost run the real worker as 2 gloo ranks (one thread each) and
read its progress through a fake agent; the isolated exchange timing calls the real
:class:`trainer.control.StepControl` on 2 spawned ranks.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from proto.job import JobSpec
from proto.progress import Finished, StepDone
from trainer.control import StepControl
from trainer.fake_agent import FakeAgent

REPO = Path(__file__).resolve().parents[1]

WORLD = 2


def run_job(workdir: Path, spec: JobSpec, env: dict[str, str]) -> list[StepDone]:
    """Run ``spec`` as WORLD local ranks; the StepDone messages rank 0 reported."""
    workdir.mkdir(parents=True)
    (workdir / "spec.json").write_bytes(msgspec.json.encode(spec))
    agent = FakeAgent(workdir / "agent.sock")
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "trainer.worker"],
            cwd=REPO,
            stderr=subprocess.DEVNULL,
            env={
                **os.environ,
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "RINGMASTER_JOB_SPEC": str(workdir / "spec.json"),
                "RINGMASTER_JOB_ID": f"bench-{workdir.name}",
                "RINGMASTER_WORKDIR": str(workdir),
                "RINGMASTER_CONTROL_SOCKET": str(agent.path),
            },
        )
        for rank in range(WORLD)
    ]
    agent.wait_for(Finished, timeout=600)
    if [p.wait(60) for p in procs] != [0] * WORLD:
        raise SystemExit(f"benchmark job in {workdir} failed")
    agent.close()
    return agent.of(StepDone)


def free_port() -> int:
    """A free TCP port for the rendezvous (released just before rank 0 binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spec(precision: str, steps: int, engine: str = "ddp") -> JobSpec:
    return msgspec.convert(
        {
            "job": {"name": "bench"},
            "train": {
                "engine": engine,
                "model": "tiny",
                "steps": steps,
                "precision": precision,
                "micro_batch_size": 8,
                "seq_len": 128,
            },
            "checkpoint": {"every_steps": 100_000},
        },
        JobSpec,
    )


def throughput(root: Path, steps: int) -> None:
    print(f"## tiny preset, {WORLD} ranks gloo (1 thread each), micro_batch 8 x seq 128")
    for engine in ("ddp", "deepspeed", "fsdp"):
        for precision in ("fp32", "fp8"):
            job = spec(precision, steps, engine)
            done = run_job(root / f"tput-{engine}-{precision}", job, {})[steps // 5 :]
            tps = statistics.median(m.tokens_per_s for m in done)
            step_ms = 1000 * statistics.median(m.step_time_s for m in done)
            label = f"{engine} " + ("fp8 (torchao, emulated)" if precision == "fp8" else "fp32")
            print(f"{label:34} {tps:9.0f} tokens/s (global)   {step_ms:6.1f} ms/step")


def control_cost(root: Path, steps: int, rounds: int = 2) -> None:
    """Wall time between consecutive StepDone reports (the step plus its boundary), on a
    small step (micro_batch 2 x seq 32) so the control word's share is as visible as it
    gets. Without it (``RINGMASTER_BENCH_NO_CONTROL=1``) rank 0 folds no words and no
    boundary broadcasts; the loss is still averaged over the ranks, as any trainer does.
    Runs alternate with and without, to spread out machine noise."""
    gaps: dict[str, list[float]] = {"with": [], "without": []}
    small = msgspec.structs.replace(
        spec("fp32", steps),
        train=msgspec.structs.replace(spec("fp32", steps).train, micro_batch_size=2, seq_len=32),
    )
    for i in range(rounds):
        for label, env in (("with", {}), ("without", {"RINGMASTER_BENCH_NO_CONTROL": "1"})):
            done = run_job(root / f"control-{label}-{i}", small, env)[steps // 5 :]
            gaps[label] += [b.time - a.time for a, b in itertools.pairwise(done)]
    with_s, without_s = (statistics.median(gaps[k]) for k in ("with", "without"))
    print(
        f"step time with the control word / without: {with_s / without_s:.3f} "
        f"({1000 * with_s:.2f} ms / {1000 * without_s:.2f} ms median, tiny fp32, "
        f"micro_batch 2 x seq 32, {rounds} x {steps} steps each)"
    )


def _exchange_loop(rank: int, port: int, calls: int, out: Any) -> None:
    """One rank of the isolated control-exchange timing (run under torch.multiprocessing)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    control = StepControl(rank, torch.device("cpu"), None)
    for _ in range(100):
        control.exchange()  # warm-up
    start = time.perf_counter()
    for _ in range(calls):
        control.exchange()
    if rank == 0:
        out.put((time.perf_counter() - start) / calls)
    dist.destroy_process_group()


def exchange_cost(calls: int = 5000) -> None:
    """The step-boundary exchange alone: StepControl.exchange() back to back on 2 ranks."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_exchange_loop, args=(free_port(), calls, out), nprocs=WORLD)
    print(f"one control exchange (3-int64 gloo broadcast), isolated: {1e6 * out.get():.0f} µs")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60, help="steps per throughput run")
    parser.add_argument("--control-steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    try:
        throughput(root, args.steps)
        control_cost(root, args.control_steps)
        exchange_cost()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
