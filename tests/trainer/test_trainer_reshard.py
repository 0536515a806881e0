"""A DDP job's checkpoint loads at another world size: a data-parallel job that lost a node
continues on fewer ranks, and grows back. Real gloo ranks train and write the checkpoints;
probe ranks (``reshard_probe.py``) load one through the engine and keep what they hold
right after loading, to compare with what was saved. DeepSpeed's ZeRO stages:
``test_trainer_zero_universal.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import reshard_probe
import torch
from dcp_files import read_dcp

from proto.job import JobSpec
from ringmaster.rank import durable

MakeSpec = Callable[..., JobSpec]


@pytest.mark.slow
def test_ddp_checkpoint_of_one_rank_loads_on_two(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    def spec(steps: int) -> JobSpec:
        return make_spec(train={"steps": steps}, checkpoint={"dir": "ckpt"})

    alone = launch(spec(4), world_size=1)
    assert alone.wait() == [0], alone.log(0)
    step_dir = tmp_path / "ckpt" / "step-4"
    saved = read_dcp(step_dir, tmp_path)
    held = tmp_path / "held"
    procs = reshard_probe.start([(spec(6), step_dir, held)], 2, tmp_path / "probe")
    reshard_probe.finish(procs, tmp_path / "probe")
    for r in range(2):
        rank = torch.load(held / f"probe-rank-{r}.pt", weights_only=False)
        for name, value in saved["model"].items():
            assert torch.equal(rank["params"][name], value), name
        state = rank["optimizer"]["state"]
        assert state.keys() == saved["optimizer"]["state"].keys() and state
        for name, moments in saved["optimizer"]["state"].items():
            assert moments["exp_avg"].abs().sum() > 0, name
            for key, value in moments.items():
                assert torch.equal(state[name][key], value), (name, key)
    both = launch(spec(6))
    assert both.wait() == [0, 0], both.log(0)
    assert both.events(1, "resumed_from")[0]["step"] == "4"


@pytest.mark.slow
def test_checkpoints_no_engine_here_can_load_are_refused_in_one_line(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    zero0 = {"engine": "deepspeed", "zero_stage": 0, "steps": 2}
    assert launch(make_spec(train=zero0)).wait() == [0, 0]
    for train, world_size, why in [
        (zero0, 1, "ZeRO-0 loads only at the world size that wrote it (2)"),
        ({"steps": 2}, 2, "another engine's (resume with deepspeed-zero0)"),
    ]:
        ranks = launch(make_spec(train=train), world_size=world_size)
        assert ranks.wait() == [1] * world_size
        log = ranks.log(0)
        refusal = [line for line in log.splitlines() if line.startswith("trainer: ")]
        assert len(refusal) == 1 and "Traceback" not in log, log
        assert "(newest step-2: deepspeed-zero0, world size 2)" in refusal[0]
        assert f"world size {world_size}) cannot load: " in refusal[0]
        assert why in refusal[0]
    assert durable.read_latest(tmp_path / "ckpt") == "step-2"
