"""Checkpoint host buffers are allocated in the background after the first step, for every
engine, so the first checkpoint finds them ready: one real rank (gloo, world size 1) in a
spawned process, each engine in turn."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow


def _held(name: str, engine: Any) -> int:
    """Bytes of host buffers (DeepSpeed) or of DCP's stager's host copies the engine holds,
    once its background allocation is done."""
    if name == "deepspeed":
        return int(engine.buffers.nbytes)  # waits for the allocation
    engine.state.wait_prepared()
    return int(engine.state.host_bytes)


def _rank(rank: int, out: str) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # as torchrun sets them
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from proto.job import TrainSection
        from ringmaster.rank.checkpoint import Written
        from trainer.engine import DDPEngine
        from trainer.engine_deepspeed import DeepSpeedEngine
        from trainer.engine_fsdp import FSDPEngine
        from trainer.model import GPT
        from trainer.presets import get_preset

        cpu = torch.device("cpu")
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
        report: dict[str, Any] = {}
        for name in ("deepspeed", "ddp", "fsdp"):
            train = TrainSection(model="tiny", micro_batch_size=2, seq_len=16, engine=name)  # type: ignore[arg-type]
            torch.manual_seed(0)
            model = GPT(get_preset("tiny"))
            engine: Any
            if name == "deepspeed":
                engine = DeepSpeedEngine(model, train, "fp32", cpu, 0, 1, None)
            elif name == "ddp":
                engine = DDPEngine(model, train, "fp32", cpu)
            else:
                engine = FSDPEngine(model, train, "fp32", cpu)
            engine.step(tokens[:, :-1], tokens[:, 1:])
            engine.prepare_snapshot()

            before_first = _held(name, engine)  # allocated before any checkpoint was taken
            staging, target = Path(out, name, "staging"), Path(out, name, "step-1")
            staging.mkdir(parents=True)
            objects = engine.snapshot(staging, target)
            for obj in objects.values():
                if isinstance(obj, Written):
                    obj.wait()
            report[name] = {"before_first": before_first, "after_first": _held(name, engine)}
            engine.close()
        Path(out, "report.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def test_every_engine_allocates_host_buffers_before_its_first_checkpoint(
    tmp_path: Path,
) -> None:
    mp.spawn(_rank, args=(str(tmp_path),), nprocs=1)
    report = json.loads((tmp_path / "report.json").read_text())
    for name in ("deepspeed", "ddp", "fsdp"):
        counts = report[name]
        # the buffers exist before the first checkpoint (weights and two Adam moments of
        # ~0.5M parameters), and it allocated none of its own: under FSDP the stager also
        # copies each DTensor's device mesh, whose rank map is a 4-byte tensor
        assert counts["before_first"] > 5e6, (name, counts)
        assert 0 <= counts["after_first"] - counts["before_first"] <= 64, (name, counts)
