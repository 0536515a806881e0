"""Trainer benchmarks on this machine's CPU (not a test): throughput, the cost of the
step-boundary control broadcast, and how long a checkpoint blocks the training loop.

    .venv/bin/python bench/trainer_bench.py [--steps 60] [--control-steps 400] [--sizes-mb 200 600]
        [--repeats 3] [--only-checkpoint]

Throughput and control cost run the real worker as 2 gloo ranks (one thread each) and
read its progress through a fake agent; the isolated exchange timing calls the real
:class:`trainer.control.StepControl` on 2 spawned ranks; the checkpoint figures run in
this process with the real :class:`trainer.checkpoint.Checkpointer` (world size 1),
comparing the in-memory snapshot the loop now blocks for with the old stage-to-files.
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
from trainer import durable
from trainer.checkpoint import Checkpointer, Coordination, HostBuffers, default_staging_dir
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


def spec(precision: str, steps: int) -> JobSpec:
    return msgspec.convert(
        {
            "job": {"name": "bench"},
            "train": {
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
    for precision in ("fp32", "fp8"):
        done = run_job(root / f"tput-{precision}", spec(precision, steps), {})[steps // 5 :]
        tps = statistics.median(m.tokens_per_s for m in done)
        step_ms = 1000 * statistics.median(m.step_time_s for m in done)
        label = "fp8 (torchao, emulated)" if precision == "fp8" else "fp32"
        print(f"{label:24} {tps:9.0f} tokens/s (global)   {step_ms:6.1f} ms/step")


def control_cost(root: Path, steps: int, rounds: int = 2) -> None:
    """Wall time between consecutive StepDone reports (the step plus its boundary), on a
    small step (micro_batch 2 x seq 32) so the broadcast's share is as visible as it gets;
    runs alternate with and without the broadcast to spread out machine noise."""
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
        f"step time with control broadcast / without: {with_s / without_s:.3f} "
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


def fake_state(megabytes: int) -> dict[str, object]:
    """Model + AdamW-shaped state (params, exp_avg, exp_avg_sq) of about ``megabytes``."""
    n = megabytes * (1 << 20) // 4 // 3 // 8
    params = {f"layer{i}.weight": torch.randn(n) for i in range(8)}
    moments = {k: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)} for k in params}
    return {"engine": {"model": params, "optimizer": {"state": moments}}, "step": 1}


def checkpoint_cost(root: Path, sizes_mb: list[int], repeats: int = 3) -> None:
    """Per state size, alternating in one run: the snapshot the loop now blocks for (host
    buffers reused across checkpoints; the first one, which allocates them, shown apart),
    the whole save done synchronously (snapshot + serialise + sha256 + fsync + manifest),
    the old blocking stage (torch.save into the RAM staging dir) and a plain torch.save."""
    print(f"## checkpoint, 1 rank: staging {default_staging_dir('bench', root)}, durable {root}")
    for megabytes in sizes_mb:
        state = fake_state(megabytes)
        buffers = HostBuffers()

        def snapshot(
            directory: Path, state: dict[str, object] = state, buffers: HostBuffers = buffers
        ) -> dict[str, Any]:
            return {"rank-0.pt": buffers.copy(state, "rank-0.pt")}

        def to_files(directory: Path, state: dict[str, object] = state) -> dict[str, Any]:
            torch.save(state, directory / "rank-0.pt")  # the old stage: serialise, loop waits
            return {}

        new = Checkpointer(
            root / f"ckpt-{megabytes}",
            default_staging_dir("bench", root),
            Coordination(),
            keep=1,
            engine="ddp",
        )
        old = Checkpointer(
            root / f"old-{megabytes}",
            default_staging_dir("bench-old", root),
            Coordination(),
            keep=1,
            engine="ddp",
        )
        first = new.save(1, snapshot)
        new.wait()
        blocked, full, old_blocked, old_full, plain = [], [], [], [], []
        for i in range(2, repeats + 2):
            start = time.monotonic()
            blocked.append(new.save(i, snapshot))
            new.wait()
            full.append(time.monotonic() - start)
            start = time.monotonic()
            old_blocked.append(old.save(i, to_files))
            old.wait()
            old_full.append(time.monotonic() - start)
            path = root / f"plain-{megabytes}.pt"
            start = time.monotonic()
            torch.save(state, path)
            with path.open("rb+") as saved:
                os.fsync(saved.fileno())
            plain.append(time.monotonic() - start)
        new.close()
        old.close()
        step_dir = root / f"ckpt-{megabytes}" / f"step-{repeats + 1}"
        size = durable.hash_file(step_dir / "rank-0.pt").size
        b, f, o, of, p = (
            statistics.median(x) for x in (blocked, full, old_blocked, old_full, plain)
        )
        print(
            f"{size / 1e6:5.0f} MB: blocked (snapshot) {b:.3f} s [first, allocating: "
            f"{first:.3f} s]; synchronous save {f:.3f} s (snapshot+serialise+sha256+fsync+"
            f"manifest) -> ratio {b / f:.3f}; old stage-to-files blocked {o:.3f} s -> ratio "
            f"{o / f:.3f} (÷ its own synchronous save {of:.3f} s: {o / of:.3f}); "
            f"plain torch.save+fsync {p:.3f} s; host buffers {buffers.nbytes / 1e6:.0f} MB "
            f"(median of {repeats})"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60, help="steps per throughput run")
    parser.add_argument("--control-steps", type=int, default=400)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[200, 600])
    parser.add_argument("--repeats", type=int, default=3, help="checkpoints per size and path")
    parser.add_argument("--only-checkpoint", action="store_true", help="skip the other parts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    try:
        if not args.only_checkpoint:
            throughput(root, args.steps)
            control_cost(root, args.control_steps)
            exchange_cost()
        checkpoint_cost(root, args.sizes_mb, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
