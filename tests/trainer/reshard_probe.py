"""One rank (torchrun's environment) that builds jobs' engines as the worker does, loads a
checkpoint through each, and keeps what it holds right after loading: the tests' window
onto a resharded load, which the worker trains on from at once.

``python reshard_probe.py LOADS.json`` takes a list of ``{"spec": JOB.json, "step_dir":
DIR, "out": DIR}``, one process for them all (importing DeepSpeed costs seconds). For
DeepSpeed, the engine saves a checkpoint into ``out`` right after loading (its own
``save_checkpoint``: what DeepSpeed's tools reconstruct, at any stage); for DDP it writes
``out/probe-rank-<r>.pt``: the module's parameters and DCP's view of the optimizer.
Tests start its ranks with :func:`start` and wait for them with :func:`finish`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from proto.job import JobSpec
from ringmaster.rank import durable
from ringmaster.rank.log import Log
from trainer.build import build_model
from trainer.engine import DDPEngine, Engine
from trainer.presets import get_preset

REPO = Path(__file__).resolve().parents[2]


def start(
    loads: list[tuple[JobSpec, Path, Path]], world_size: int, workdir: Path
) -> list[subprocess.Popen[bytes]]:
    """Start ``world_size`` probe ranks (logs in ``workdir``), each loading every
    ``(spec, step_dir, out)`` of ``loads`` in turn; returns the processes."""
    workdir.mkdir()
    listed = []
    for n, (spec, step_dir, out) in enumerate(loads):
        out.mkdir()
        spec_path = workdir / f"spec-{n}.json"
        spec_path.write_bytes(msgspec.json.encode(spec))
        listed.append({"spec": str(spec_path), "step_dir": str(step_dir), "out": str(out)})
    (workdir / "loads.json").write_text(json.dumps(listed))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
        }
        args = [sys.executable, __file__, str(workdir / "loads.json")]
        with (workdir / f"rank-{rank}.log").open("wb") as log:
            procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=log, cwd=workdir))
    return procs


def finish(procs: list[subprocess.Popen[bytes]], workdir: Path, timeout: float = 600) -> None:
    """Wait for the ranks :func:`start` started; all must succeed."""
    try:
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * len(procs), (workdir / "rank-0.log").read_text()[-3000:]


def probe(spec_path: Path, step_dir: Path, out: Path, rank: int, world_size: int) -> None:
    spec = msgspec.json.decode(spec_path.read_bytes(), type=JobSpec)
    train = spec.train
    device = torch.device("cpu")
    torch.manual_seed(train.seed + 1)  # other initial weights than the checkpoint's
    model = build_model(train, get_preset(train.model), device, Log(rank))
    if train.engine == "deepspeed":
        from trainer.engine_deepspeed import TAG, DeepSpeedEngine

        zero = DeepSpeedEngine(model, train, train.precision, device, rank, world_size, None)
        load(zero, step_dir)
        zero.ds.save_checkpoint(str(out), tag=TAG, save_latest=False)
        zero.ds.destroy()
        return
    group = dist.new_group(backend="gloo")
    engine = DDPEngine(model, train, train.precision, device, checkpoint_group=group)
    load(engine, step_dir)
    held: dict[str, Any] = {"params": dict(engine.module.state_dict())}
    held["optimizer"] = get_state_dict(engine.module, engine.optimizer)[1]  # by name
    torch.save(held, out / f"probe-rank-{rank}.pt")


def load(engine: Engine, step_dir: Path) -> None:
    """As the worker resumes: the files this rank needs verified, then the engine loads."""
    manifest = durable.read_manifest(step_dir)
    assert manifest is not None
    files = engine.files_for(manifest)
    assert files is not None, engine.refusal(manifest)
    assert all(durable.verify(step_dir, manifest, name) for name in files)
    engine.load(step_dir, manifest)


def main(loads_path: str) -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://")
    for load in json.loads(Path(loads_path).read_text()):
        paths = [Path(load[key]) for key in ("spec", "step_dir", "out")]
        probe(*paths, rank, world_size)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the worker: no interpreter teardown among gloo threads
