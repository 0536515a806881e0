"""DeepSpeed ZeRO checkpoints load at another world size, through DeepSpeed's Universal
Checkpointing: a job of each stage checkpoints on 2 real gloo ranks; probe ranks
(``reshard_probe.py``) load it through the engine on 1 and on 3 ranks and save what they
hold right after loading; DeepSpeed's own tools (``zero_to_fp32`` and ``ds_to_universal``)
must reconstruct the same fp32 master weights and Adam moments from both. Then real ranks
resume at the new world size and train on."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import reshard_probe
import torch

from proto.job import JobSpec
from ringmaster.rank import durable
from trainer.engine_deepspeed import UNIVERSAL

pytestmark = pytest.mark.slow
MakeSpec = Callable[..., JobSpec]
STAGES = [(1, "fp32"), (2, "bf16"), (3, "bf16")]  # precisions spread over the stages


def reconstruct(tag_dir: Path, scratch: Path) -> dict[str, Any]:
    """DeepSpeed's own view of the ZeRO checkpoint in ``tag_dir``, per parameter: the fp32
    master weights (``zero_to_fp32`` and ``ds_to_universal``), Adam's moments and, where
    it writes one, step (``ds_to_universal``)."""
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(scratch / tag_dir.name),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        ds_to_universal.main(args)
    found: dict[str, Any] = {f"{name}/zero_to_fp32": value for name, value in fp32.items()}
    for path in sorted((scratch / tag_dir.name / "zero").glob("*/*.pt")):
        value = torch.load(path, weights_only=False)
        found[f"{path.parent.name}/{path.stem}"] = (
            value["param"] if isinstance(value, dict) else value
        )
    return found


def mismatches(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """The keys whose values differ (in dtype or any element), or are missing on one side."""
    bad = sorted(expected.keys() ^ got.keys())
    for key in expected.keys() & got.keys():
        a, b = torch.as_tensor(expected[key]), torch.as_tensor(got[key])
        if a.dtype != b.dtype or not torch.equal(a, b):
            bad.append(key)
    return bad


def losses(workdir: Path) -> list[float]:
    lines = (workdir / "trace-rank-0.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_zero_checkpoints_of_two_ranks_load_on_one_and_three(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    def spec(stage: int, precision: str, steps: int) -> JobSpec:
        train = {"engine": "deepspeed", "zero_stage": stage, "precision": precision}
        checkpoint = {"every_steps": 4, "dir": str(tmp_path / f"ckpt-{stage}")}
        return make_spec(train={**train, "steps": steps}, checkpoint=checkpoint)

    def trace(stage: int) -> Path:
        return tmp_path / f"trace-{stage}"

    def job_env(stage: int) -> dict[str, str]:
        """The jobs of several stages run at once, each in a workdir of its own."""
        workdir = tmp_path / f"job-{stage}"
        workdir.mkdir(exist_ok=True)
        return {"RINGMASTER_WORKDIR": str(workdir), "RINGMASTER_TEST_TRACE": str(trace(stage))}

    jobs = []
    for stage, precision in STAGES:  # each on 2 ranks, checkpointing steps 4 and 8
        trace(stage).mkdir()
        jobs.append(launch(spec(stage, precision, 8), env=job_env(stage), job_id=f"zero{stage}"))
    for ranks in jobs:
        assert ranks.wait(600) == [0, 0], ranks.log(0)

    # probe ranks load each step-8 on 1 and on 3 ranks, one process per rank for them all;
    # the two at once, so each from its own copy (the converted copy has one place per dir)
    def ckpt(stage: int, world_size: int) -> Path:
        return tmp_path / (f"ckpt-{stage}" if world_size == 1 else f"ckpt-{stage}-copy")

    def held(stage: int, world_size: int) -> Path:
        return tmp_path / f"held-{stage}-on-{world_size}"

    for stage, _ in STAGES:
        shutil.copytree(ckpt(stage, 1), ckpt(stage, 3))
    probes = {
        world_size: reshard_probe.start(
            [
                (spec(s, p, 8), ckpt(s, world_size) / "step-8", held(s, world_size))
                for s, p in STAGES
            ],
            world_size,
            tmp_path / f"probe-{world_size}",
        )
        for world_size in (1, 3)
    }
    for world_size, procs in probes.items():
        reshard_probe.finish(procs, tmp_path / f"probe-{world_size}")

    scratch = iter(range(100))
    for stage, _ in STAGES:
        saved = reconstruct(ckpt(stage, 1) / "step-8" / "ds", tmp_path / f"uc-{next(scratch)}")
        assert saved["tok_emb.weight/exp_avg"].abs().sum() > 0  # trained, not a fresh optimizer
        earlier = reconstruct(ckpt(stage, 1) / "step-4" / "ds", tmp_path / f"uc-{next(scratch)}")
        for world_size in (1, 3):
            tag_dir = held(stage, world_size) / "ds"
            assert len(list(tag_dir.glob("*optim_states.pt"))) == world_size  # saved there
            loaded = reconstruct(tag_dir, tmp_path / f"uc-{next(scratch)}")
            assert mismatches(saved, loaded) == [], (stage, world_size)
            # the negative control: step 4's state is not what was loaded
            moments = {k for k in saved if k.endswith(("/fp32", "/exp_avg", "/exp_avg_sq"))}
            assert moments <= set(mismatches(earlier, loaded)), (stage, world_size)
            # the converted copy is gone: the step dirs are all that resume would see
            names = sorted(p.name for p in ckpt(stage, world_size).iterdir())
            assert names == ["latest", "step-4", "step-8"], names
            assert not (ckpt(stage, world_size) / UNIVERSAL).exists()

    # real ranks resume at the new world size and train on (the probes showed from what)
    resumed = []
    for (stage, precision), world_size in zip(STAGES, (1, 3, 1), strict=True):
        ranks = launch(
            spec(stage, precision, 10),
            world_size=world_size,
            env=job_env(stage),
            job_id=f"zero{stage}",
        )
        resumed.append((stage, world_size, ranks))
    for stage, world_size, ranks in resumed:
        assert ranks.wait(600) == [0] * world_size, ranks.log(0)
        assert ranks.events(0, "resumed_from")[0]["step"] == "8"
        after = losses(trace(stage))[8:]
        assert len(after) == 2 and all(math.isfinite(loss) for loss in after), after
        step_10 = durable.read_manifest(tmp_path / f"ckpt-{stage}" / "step-10")
        assert step_10 is not None and step_10.world_size == world_size
