"""The DeepSpeed engine on two real CPU ranks: ZeRO checkpoints through the same
two-stage pipeline, resumed bit-identically, and nothing left in /dev/shm."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from proto.job import JobSpec
from ringmaster.rank import durable

pytestmark = pytest.mark.slow
MakeSpec = Callable[..., JobSpec]


def losses(workdir: Path, rank: int) -> list[float]:
    lines = (workdir / f"trace-rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def tensors(obj: Any, at: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside a loaded checkpoint object, by its path of keys and indices."""
    if isinstance(obj, torch.Tensor):
        return {at: obj}
    items: Any = ()
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list | tuple):
        items = enumerate(obj)
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        found.update(tensors(value, f"{at}/{key}"))
    return found


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a DeepSpeed step dir: parameters, fp32 master copies, Adam moments."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted((step_dir / "ds").glob("*.pt")):
        found.update(tensors(torch.load(path, map_location="cpu", weights_only=False), path.name))
    return found


@pytest.mark.parametrize(
    ("stage", "precision"),
    [(1, "fp32"), (2, "bf16"), (3, "fp8")],  # each stage once; precisions spread over them
)
def test_zero_resume_in_a_fresh_process_matches_uninterrupted_run(
    tmp_path: Path, launch: Any, make_spec: MakeSpec, stage: int, precision: str
) -> None:
    ds = {"engine": "deepspeed", "zero_stage": stage, "precision": precision}
    if precision == "fp8":
        ds["fp8_recipe"] = "tensorwise"  # "auto" leaves tiny's small linears alone
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
    for rank in (0, 1):  # the same next-step losses, to the bit
        assert losses(interrupted, rank) == losses(straight, rank)
    manifest = durable.read_manifest(tmp_path / "a" / "step-5")
    assert manifest is not None and manifest.engine == f"deepspeed-zero{stage}"
    # rank 1 persisted its own optimizer partition (``bf16_``-prefixed under bf16)
    assert any(n.endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt") for n in manifest.ranks["1"])
    # the resumed run ends with bit-identical parameters and optimizer state
    resumed, uninterrupted = (checkpoint_tensors(tmp_path / d / "step-5") for d in "ab")
    assert resumed.keys() == uninterrupted.keys() and len(resumed) > 10
    for key, value in resumed.items():
        assert value.dtype == uninterrupted[key].dtype, key
        assert torch.equal(value, uninterrupted[key]), key


def test_zero1_bf16_trains_and_leaves_no_shared_memory(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
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
    # other tests' jobs may be staging in /dev/shm at this moment: look for this job's only
    assert launch.job_id and not [p for p in Path("/dev/shm").iterdir() if launch.job_id in p.name]
