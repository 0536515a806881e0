"""The DeepSpeed engine on two real CPU ranks: ZeRO checkpoints through the same
two-stage pipeline, resumed bit-identically, and nothing left in /dev/shm."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proto.job import JobSpec
from trainer import durable

pytestmark = pytest.mark.slow
MakeSpec = Callable[..., JobSpec]


def losses(workdir: Path, rank: int) -> list[float]:
    lines = (workdir / f"trace-rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_zero3_fp8_resume_matches_uninterrupted_run(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    ds = {"engine": "deepspeed", "zero_stage": 3, "precision": "fp8"}
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    interrupted.mkdir()
    straight.mkdir()
    for steps in (3, 5):  # 3 steps, then a fresh launch resumes to 5
        spec = make_spec(train={**ds, "steps": steps}, checkpoint={"dir": "a"})
        ranks = launch(spec, env={"RINGMASTER_TEST_TRACE": str(interrupted)})
        assert ranks.wait() == [0, 0], ranks.log(0)
    assert ranks.events(1, "resumed_from")[0]["step"] == "3"
    spec = make_spec(train={**ds, "steps": 5}, checkpoint={"dir": "b"})
    assert launch(spec, env={"RINGMASTER_TEST_TRACE": str(straight)}).wait() == [0, 0]
    for rank in (0, 1):
        assert losses(interrupted, rank) == losses(straight, rank)
    manifest = durable.read_manifest(tmp_path / "a" / "step-5")
    assert manifest is not None and manifest.engine == "deepspeed-zero3"
    assert "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt" in manifest.ranks["1"]


def test_zero1_bf16_trains_and_leaves_no_shared_memory(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    before = set(Path("/dev/shm").iterdir())
    spec = make_spec(
        train={"engine": "deepspeed", "zero_stage": 1, "precision": "bf16", "steps": 4}
    )
    ranks = launch(spec)
    assert ranks.wait() == [0, 0], ranks.log(0)
    steps = ranks.events(0, "step")
    assert len(steps) == 4 and all(0 < float(s["loss"]) < 10 for s in steps)
    assert ranks.events(0, "model")[0]["engine"] == "deepspeed-zero1"
    assert durable.read_latest(tmp_path / "ckpt") == "step-4"
    # DeepSpeed's state dicts were captured in memory, not serialised in the loop: rank 0's
    # model states + each rank's optimizer partition + the trainer's step and RNG
    staged = [ranks.events(r, "checkpoint_staged")[0]["in_memory"] for r in (0, 1)]
    assert staged == ["3", "2"]
    assert set(Path("/dev/shm").iterdir()) <= before
