"""The FSDP2 engine on two real CPU ranks, float8 weights all-gathered in float8: DCP
checkpoints written by every rank, resumed bit-identically in a fresh process, and resharded
onto a smaller world."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dcp_files import read_dcp

from proto.job import JobSpec
from ringmaster.rank import durable

pytestmark = pytest.mark.slow
MakeSpec = Callable[..., JobSpec]


def losses(workdir: Path, rank: int) -> list[float]:
    lines = (workdir / f"trace-rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def dcp_bytes(manifest: durable.Manifest, rank: str) -> int:
    return sum(manifest.files[f].size for f in manifest.ranks[rank] if f.startswith("dcp/__"))


def test_fsdp_fp8_resume_is_bit_identical_and_reshards_to_one_rank(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    fsdp = {"engine": "fsdp", "precision": "fp8", "fp8_recipe": "tensorwise"}
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    interrupted.mkdir()
    straight.mkdir()
    for steps in (3, 5):  # 3 steps, then a fresh launch resumes to 5
        spec = make_spec(train={**fsdp, "steps": steps}, checkpoint={"dir": "a"})
        ranks = launch(spec, env={"RINGMASTER_TEST_TRACE": str(interrupted)})
        assert ranks.wait() == [0, 0], ranks.log(0)
    assert ranks.events(1, "resumed_from")[0]["step"] == "3"
    model = ranks.events(0, "model")[0]
    assert (model["engine"], model["float8_linears"]) == ("fsdp", "8")
    spec = make_spec(train={**fsdp, "steps": 5}, checkpoint={"dir": "b"})
    assert launch(spec, env={"RINGMASTER_TEST_TRACE": str(straight)}).wait() == [0, 0]
    for rank in (0, 1):  # the same next-step losses, to the bit
        assert losses(interrupted, rank) == losses(straight, rank)
    manifest = durable.read_manifest(tmp_path / "a" / "step-5")
    assert manifest is not None and manifest.engine == "fsdp"
    # sharded: each rank wrote about half of the parameters and optimizer state
    halves = [dcp_bytes(manifest, r) for r in ("0", "1")]
    assert min(halves) > 0.4 * sum(halves), halves
    resumed, uninterrupted = (read_dcp(tmp_path / d / "step-5", tmp_path) for d in "ab")
    assert resumed["model"].keys() == uninterrupted["model"].keys()
    for name, value in resumed["model"].items():
        assert value.dtype == torch.float32, name  # the unwrapped high-precision weight
        assert torch.equal(value, uninterrupted["model"][name]), name
    moments_a, moments_b = resumed["optimizer"]["state"], uninterrupted["optimizer"]["state"]
    assert moments_a.keys() == moments_b.keys() and moments_a
    for key, moments in moments_a.items():
        assert torch.equal(moments["exp_avg"], moments_b[key]["exp_avg"]), key
    # a node lost: one rank loads the two ranks' shards and carries on
    alone = make_spec(train={**fsdp, "steps": 6}, checkpoint={"dir": "b"})
    ranks = launch(alone, world_size=1)
    assert ranks.wait() == [0], ranks.log(0)
    assert ranks.events(0, "resumed_from")[0]["step"] == "5"
    final = durable.read_manifest(tmp_path / "b" / "step-6")
    assert final is not None and final.world_size == 1
