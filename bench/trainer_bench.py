"""Trainer benchmarks on this machine's CPU (not a test): throughput and the cost of the
step-boundary control word (checkpoint stalls: ``bench/checkpoint_bench.py``).

    .venv/bin/python bench/trainer_bench.py [--steps 60] [--control-steps 400] [--control-rounds 6]
        [--memory-steps 300] [--memory-rounds 4] [--parts throughput control exchange memory]

Throughput and control cost run the real worker as 2 gloo ranks (one thread each) and
read its progress through a fake agent; the isolated exchange timing calls the real
:class:`ringmaster.rank.control.StepControl` on 2 spawned ranks. Each rank is its own node
(``RINGMASTER_NODE``), so the memory tier copies every snapshot to the other rank.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.snapshot_cost import in_run_ratio, snapshot_steps
from proto.job import JobSpec
from proto.progress import Finished, StepDone
from ringmaster.rank.control import StepControl
from ringmaster.rank.fake_agent import FakeAgent

REPO = Path(__file__).resolve().parents[1]

WORLD = 2


def run_job(workdir: Path, spec: JobSpec, env: dict[str, str]) -> list[StepDone]:
    """Run ``spec`` as WORLD local ranks (logs in ``workdir/rank-<r>.log``); the StepDone
    messages rank 0 reported."""
    workdir.mkdir(parents=True)
    (workdir / "spec.json").write_bytes(msgspec.json.encode(spec))
    agent = FakeAgent(workdir / "agent.sock")
    port = free_port()
    logs = [(workdir / f"rank-{rank}.log").open("wb") for rank in range(WORLD)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "trainer.worker"],
            cwd=REPO,
            stderr=logs[rank],
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
                "RINGMASTER_NODE": f"bench-node-{rank}",
            },
        )
        for rank in range(WORLD)
    ]
    agent.wait_for(Finished, timeout=600)
    codes = [p.wait(60) for p in procs]
    for log in logs:
        log.close()
    if codes != [0] * WORLD:
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


def control_cost(root: Path, steps: int, rounds: int) -> None:
    """Wall time between consecutive StepDone reports (the step plus its boundary), on a
    small step (micro_batch 2 x seq 32) so the control word's share is as visible as it
    gets. Without it (``RINGMASTER_BENCH_NO_CONTROL=1``) rank 0 folds no words and no
    boundary broadcasts; the loss is still averaged over the ranks, as any trainer does.
    Each round runs the job once with and once without, back to back; whole runs differ by
    several percent on this machine whatever they do, so the figure is the median over the
    rounds of each round's ratio of median steps."""
    small = msgspec.structs.replace(
        spec("fp32", steps),
        train=msgspec.structs.replace(spec("fp32", steps).train, micro_batch_size=2, seq_len=32),
    )
    ratios, medians = [], []
    for i in range(rounds):
        step_s = {}
        for label, env in (("with", {}), ("without", {"RINGMASTER_BENCH_NO_CONTROL": "1"})):
            done = run_job(root / f"control-{label}-{i}", small, env)[steps // 5 :]
            step_s[label] = statistics.median(b.time - a.time for a, b in itertools.pairwise(done))
        ratios.append(step_s["with"] / step_s["without"])
        medians.append(step_s["with"])
    print(
        f"step time with the control word / without: {statistics.median(ratios):.3f} "
        f"(median of {rounds} rounds: {', '.join(f'{r:.3f}' for r in ratios)}; "
        f"{1000 * statistics.median(medians):.2f} ms a step with it; tiny fp32, "
        f"micro_batch 2 x seq 32, {steps} steps a run)"
    )


def _exchange_loop(rank: int, port: int, calls: int, out: Any) -> None:
    """One rank of the isolated control timings (run under torch.multiprocessing): the
    boundary broadcast, and the step-end all-reduce with and without the word, in
    alternating blocks so drift hits both alike. Rank 0 drains a real (unconnected)
    AgentLink, as in a job."""
    import torch.distributed as dist

    from ringmaster.rank.agent_link import AgentLink

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    link = AgentLink(Path(tempfile.gettempdir()) / "unused.sock", "bench") if rank == 0 else None
    cpu = torch.device("cpu")
    control = StepControl(rank, cpu, link)
    variants = {"with": control, "without": StepControl(rank, cpu, link, enabled=False)}
    loss = torch.tensor(2.5)

    def timed(fn: Any, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - start

    timed(control.exchange, 100)  # warm-up
    broadcast = timed(control.exchange, calls) / calls
    totals = dict.fromkeys(variants, 0.0)
    for _ in range(10):
        for name, variant in variants.items():
            totals[name] += timed(lambda v=variant: v.reduce_step(loss, WORLD), calls // 10)
    if rank == 0:
        out.put((broadcast, totals["with"] / calls, totals["without"] / calls))
    dist.destroy_process_group()


def exchange_cost(calls: int = 5000) -> None:
    """The control word's cost isolated on 2 ranks: the boundary broadcast (first boundary
    and while paused) and what the word adds to each step's loss all-reduce."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_exchange_loop, args=(free_port(), calls, out), nprocs=WORLD)
    broadcast, with_word, without = out.get()
    print(
        f"boundary broadcast (3-float64 gloo), isolated: {1e6 * broadcast:.0f} µs; step-end "
        f"all-reduce with the word {1e6 * with_word:.0f} µs, without {1e6 * without:.0f} µs "
        f"-> the word adds {1e6 * (with_word - without):.1f} µs a step"
    )


def memory_cost(root: Path, steps: int, rounds: int) -> None:
    """Step time with the memory tier on over off, for ``examples/tiny.toml``'s training
    (DeepSpeed ZeRO-1, float8 tensorwise) and no durable checkpoint but the last: the
    mean time between consecutive StepDone reports after the first fifth (a mean, not a
    median: a snapshot every few steps is exactly what a median would hide). Each round
    runs the job once with the tier and once without, back to back; the figure is the
    median of the rounds' ratios, beside the cadence and snapshot cost rank 0 logged, and
    the same ratio read from within each run with the tier (``bench/snapshot_cost.py``),
    which launch-to-launch noise does not reach."""
    base = spec("fp8", steps, "deepspeed")
    train = msgspec.structs.replace(
        base.train, fp8_recipe="tensorwise", micro_batch_size=4, zero_stage=1
    )
    ratios, in_run, logged = [], [], []
    for i in range(rounds):
        mean_s = {}
        for label, on in (("on", True), ("off", False)):
            ckpt = msgspec.structs.replace(base.checkpoint, memory_tier=on)
            job = msgspec.structs.replace(base, train=train, checkpoint=ckpt)
            workdir = root / f"memory-{label}-{i}"
            done = run_job(workdir, job, {})[steps // 5 :]
            mean_s[label] = (done[-1].time - done[0].time) / (len(done) - 1)
            if on:
                snaps = snapshot_steps([d.memory_step for d in done])
                try:
                    in_run.append(
                        in_run_ratio([d.step for d in done], [d.time for d in done], snaps)
                    )
                except ValueError as exc:  # too few snapshots in the run to compare
                    print(f"round {i}: no in-run figure: {exc}")
                lines = (workdir / "rank-0.log").read_text().splitlines()
                logged += [ln for ln in lines if "event=memory_tier step=" in ln][-1:]
                logged += [ln for ln in lines if "event=finished" in ln][-1:]
        ratios.append(mean_s["on"] / mean_s["off"])
    print(
        f"step time with the memory tier / without: {statistics.median(ratios):.3f} "
        f"(median of {rounds} rounds: {', '.join(f'{r:.3f}' for r in ratios)}; tiny "
        f"deepspeed ZeRO-1 fp8 tensorwise, micro_batch 4 x seq 128, {steps} steps a run)"
    )
    if in_run:
        print(
            f"the same from within each run with the tier (steps near a snapshot against "
            f"the others): {statistics.median(in_run):.3f} "
            f"(rounds: {', '.join(f'{r:.3f}' for r in in_run)})"
        )
    for line in logged[-2:]:
        print("  rank 0:", line.split("event=", 1)[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60, help="steps per throughput run")
    parser.add_argument("--control-steps", type=int, default=400)
    parser.add_argument("--control-rounds", type=int, default=6)
    parser.add_argument("--memory-steps", type=int, default=300)
    parser.add_argument("--memory-rounds", type=int, default=4)
    parts = ("throughput", "control", "exchange", "memory")
    parser.add_argument("--parts", nargs="+", choices=parts, default=list(parts))
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    try:
        if "throughput" in args.parts:
            throughput(root, args.steps)
        if "control" in args.parts:
            control_cost(root, args.control_steps, args.control_rounds)
        if "exchange" in args.parts:
            exchange_cost()
        if "memory" in args.parts:
            memory_cost(root, args.memory_steps, args.memory_rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
