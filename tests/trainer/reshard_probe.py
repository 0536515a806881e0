"""One rank (torchrun's environment) that builds a job's engine as the worker does, loads a
checkpoint through the engine, and saves what it holds right after loading: the tests'
window onto a resharded load, which the worker trains on from at once.

``python reshard_probe.py SPEC.json STEP_DIR OUT_DIR`` writes ``OUT_DIR/probe-rank-<r>.pt``:
the module's parameters and, for DeepSpeed, this rank's slice of the fp32 master weights
and the Adam state of the (single) parameter group; for DDP, DCP's view of the optimizer.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict

from proto.job import JobSpec
from trainer import durable
from trainer.build import build_model
from trainer.engine import DDPEngine, Engine
from trainer.log import Log
from trainer.presets import get_preset


def main(spec_path: str, step_dir: Path, out: Path) -> None:
    spec = msgspec.json.decode(Path(spec_path).read_bytes(), type=JobSpec)
    train = spec.train
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    dist.init_process_group("gloo", init_method="env://")
    group = dist.new_group(backend="gloo")
    torch.manual_seed(train.seed + 1)  # other initial weights than the checkpoint's
    model = build_model(train, get_preset(train.model), device, Log(rank))
    engine: Engine
    if train.engine == "deepspeed":
        from trainer.engine_deepspeed import DeepSpeedEngine

        engine = DeepSpeedEngine(model, train, train.precision, device, rank, world_size)
    else:
        engine = DDPEngine(model, train, train.precision, device, checkpoint_group=group)
    manifest = durable.read_manifest(step_dir)
    assert manifest is not None
    files = engine.files_for(manifest)
    assert files, engine.refusal(manifest)
    assert all(durable.verify(step_dir, manifest, name) for name in files)
    engine.load(step_dir, manifest)
    held: dict[str, Any] = {"params": dict(engine.module.state_dict())}
    if isinstance(engine, DDPEngine):
        held["optimizer"] = get_state_dict(engine.module, engine.optimizer)[1]  # by name
    else:
        zero = engine.ds.optimizer
        (master,) = zero.single_partition_of_fp32_groups
        held["fp32"] = master
        held["adam"] = dict(zero.optimizer.state[master])
    torch.save(held, out / f"probe-rank-{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the worker: no interpreter teardown among gloo threads
