"""How long a checkpoint blocks the training loop, against the same checkpoint saved
synchronously (not a test).

    .venv/bin/python bench/checkpoint_bench.py [--sizes-mb 200 600] [--repeats 3]
        [--ddp-preset 125m] [--ddp-rounds 2]

Per state size (parameters + AdamW's two moments, fp32), in one process with a one-rank
gloo group, through the real :class:`ringmaster.rank.checkpoint.Checkpointer`:

* DCP (the DDP and FSDP engines): :class:`ringmaster.rank.dcp_async.DcpState` over a model of that
  size. Blocked = what ``Checkpointer.save`` returns (``async_save`` staging into reused
  host buffers, plus the step/RNG file's snapshot); synchronous = the same save waited for
  to the end (staging, DCP's write with fsync, sha256 of every file, manifest, ``latest``).
* Host buffers (the DeepSpeed engine's capture): the state dicts copied into reused host
  buffers; synchronous = that save waited for (``torch.save``, sha256, fsync, manifest).

The first checkpoint of each path allocates its host buffers; it is shown apart and left
out of the medians, as it happens once per run.

Last, two real DDP ranks (the worker on the ``--ddp-preset`` model): each rank's blocked
time when it stages only its share of the replicated state against every rank staging all
of it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from ringmaster.rank import durable
from ringmaster.rank.checkpoint import Checkpointer, HostBuffers, default_staging_dir
from ringmaster.rank.coordination import Coordination
from ringmaster.rank.dcp_async import DcpState
from ringmaster.rank.log import read

WIDTH = 1024  # one layer: a WIDTH x WIDTH fp32 weight and its two moments, 12 MiB


def trained_model(megabytes: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear layers whose weights + AdamW moments come to about ``megabytes``, after one
    optimizer step (so the moments exist)."""
    layers = max(1, round(megabytes * (1 << 20) / (3 * 4 * WIDTH * WIDTH)))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def timed(
    ckpt: Checkpointer, stage: Callable[[Path, Path], dict[str, Any]], repeats: int
) -> tuple[float, list[float], list[float]]:
    """The first save's block, then per later save: blocked, and blocked + persist."""
    first = ckpt.save(1, stage)
    ckpt.wait()
    blocked, full = [], []
    for step in range(2, repeats + 2):
        start = time.monotonic()
        blocked.append(ckpt.save(step, stage))
        ckpt.wait()
        full.append(time.monotonic() - start)
        if ckpt.durable_step != step:
            raise SystemExit(f"checkpoint step {step} did not become durable")
    ckpt.close()
    return first, blocked, full


def report(label: str, size: int, first: float, blocked: list[float], full: list[float]) -> None:
    ratios = [x / y for x, y in zip(blocked, full, strict=True)]
    b, f = statistics.median(blocked), statistics.median(full)
    print(
        f"{label:13} {size / 1e6:5.0f} MB: blocked {b:.3f} s, synchronous save {f:.3f} s "
        f"(medians) -> ratio {statistics.median(ratios):.3f} (median of "
        f"{', '.join(f'{r:.3f}' for r in ratios)}; first, allocating: {first:.3f} s)"
    )


def step_file(step: int) -> dict[str, Any]:
    """What the trainer adds to every engine's snapshot: its step and RNG."""
    return {durable.trainer_file(0): {"step": step, "rng": {"cpu": torch.get_rng_state()}}}


def dcp_path(root: Path, megabytes: int, repeats: int) -> None:
    model, optimizer = trained_model(megabytes)
    state = DcpState(model, optimizer, dist.group.WORLD)
    staging = default_staging_dir("bench-dcp", root)
    ckpt = Checkpointer(root / f"dcp-{megabytes}", staging, Coordination(), keep=1, engine="ddp")

    def stage(staging: Path, target: Path) -> dict[str, Any]:
        return {**state.snapshot(target), **step_file(0)}

    first, blocked, full = timed(ckpt, stage, repeats)
    state.close()
    manifest = durable.read_manifest(root / f"dcp-{megabytes}" / f"step-{repeats + 1}")
    assert manifest is not None
    size = sum(e.size for name, e in manifest.files.items() if name.startswith("dcp/"))
    report("DCP", size, first, blocked, full)


def host_buffers_path(root: Path, megabytes: int, repeats: int) -> None:
    model, optimizer = trained_model(megabytes)
    buffers = HostBuffers()
    shard = durable.shard_name(0)
    staging = default_staging_dir("bench-hb", root)
    ckpt = Checkpointer(root / f"hb-{megabytes}", staging, Coordination(), keep=1, engine="ds")

    def stage(staging: Path, target: Path) -> dict[str, Any]:
        live = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        return {shard: buffers.copy(live, shard), **step_file(0)}

    first, blocked, full = timed(ckpt, stage, repeats)
    size = durable.hash_file(root / f"hb-{megabytes}" / f"step-{repeats + 1}" / shard).size
    report("host buffers", size, first, blocked, full)


def ddp_ranks(root: Path, preset: str, rounds: int) -> None:
    """Two real DDP ranks (the worker, checkpoint every 2 steps): what each rank's loop is
    blocked for when it stages only its share of the replicated state, against every rank
    staging all of it (``RINGMASTER_BENCH_DDP_STAGE_ALL=1``), alternating in one run."""
    from trainer_bench import WORLD, run_job, spec

    job = spec("fp32", 8, "ddp")
    train = msgspec.structs.replace(job.train, model=preset, micro_batch_size=1, seq_len=64)
    job = msgspec.structs.replace(
        job, train=train, checkpoint=msgspec.structs.replace(job.checkpoint, every_steps=2)
    )
    stalls: dict[str, list[float]] = {"share": [], "all": []}
    for i in range(rounds):
        for label, env in (("share", {}), ("all", {"RINGMASTER_BENCH_DDP_STAGE_ALL": "1"})):
            workdir = root / f"ddp-{label}-{i}"
            run_job(workdir, job, env)
            for rank in range(WORLD):
                log = (workdir / f"rank-{rank}.log").read_text()
                staged = [r["stall_s"] for r in read(log) if r["event"] == "checkpoint_staged"]
                stalls[label] += [float(x) for x in staged[1:]]  # the first one allocates
    share, whole = (statistics.median(stalls[k]) for k in ("share", "all"))
    print(
        f"DDP, {WORLD} ranks, {preset} preset: blocked {share:.3f} s staging its share vs "
        f"{whole:.3f} s staging all -> {share / whole:.2f} (median over ranks and "
        f"{len(stalls['share'])} checkpoints)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[200, 600])
    parser.add_argument("--repeats", type=int, default=3, help="checkpoints per size and path")
    parser.add_argument("--ddp-preset", default="125m", help="model of the 2-rank DDP part")
    parser.add_argument("--ddp-rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    root = Path(tempfile.mkdtemp(prefix="checkpoint-bench-"))
    print(f"## checkpoint, 1 rank: staging {default_staging_dir('bench', root)}, durable {root}")
    try:
        for megabytes in args.sizes_mb:
            dcp_path(root, megabytes, args.repeats)
            host_buffers_path(root, megabytes, args.repeats)
        ddp_ranks(root, args.ddp_preset, args.ddp_rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
