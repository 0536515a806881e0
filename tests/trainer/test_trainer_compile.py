"""``train.compile`` through the real worker, for each engine: blocks compiled (with the
cheap ``aot_eager`` backend: Inductor's CPU compile takes half a minute) under activation
checkpointing train to the same losses as eager ones, and rank 0 reports compile_s once,
on its second step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proto.job import JobSpec
from proto.progress import StepDone
from ringmaster.rank.fake_agent import FakeAgent

pytestmark = pytest.mark.slow


def losses(workdir: Path) -> list[float]:
    lines = (workdir / "trace-rank-0.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.parametrize(
    "train",
    [
        {"engine": "ddp", "precision": "bf16"},
        {"engine": "fsdp", "precision": "fp8", "fp8_recipe": "tensorwise"},
        {"engine": "deepspeed", "zero_stage": 3, "precision": "fp8", "fp8_recipe": "tensorwise"},
    ],
    ids=["ddp-bf16", "fsdp-fp8", "zero3-fp8"],
)
def test_compiled_checkpointed_blocks_train_as_eager_ones(
    tmp_path: Path, launch: Any, make_spec: Callable[..., JobSpec], train: dict[str, Any]
) -> None:
    runs = {}
    for compiled in (False, True):
        workdir = tmp_path / f"compiled-{compiled}"
        workdir.mkdir()
        settings = {**train, "steps": 4, "activation_checkpointing": True, "compile": compiled}
        spec = make_spec(train=settings, checkpoint={"dir": f"ckpt-{compiled}"})
        agent = FakeAgent(tmp_path / f"agent-{compiled}.sock")
        env = {
            "RINGMASTER_TEST_TRACE": str(workdir),
            "RINGMASTER_TEST_COMPILE_BACKEND": "aot_eager",
            "RINGMASTER_COMPILE_CACHE": str(tmp_path / "compile-cache"),
        }
        ranks = launch(spec, world_size=1, socket_path=agent.path, env=env)
        assert ranks.wait() == [0], ranks.log(0)
        model = ranks.events(0, "model")[0]
        assert (model["compiled"], model["activation_checkpointing"]) == (str(compiled), "True")
        runs[compiled] = (losses(workdir), [m.compile_s for m in agent.of(StepDone)], ranks)
        agent.close()
    (eager, eager_compile_s, _), (compiled_losses, compile_s, ranks) = runs[False], runs[True]
    assert compiled_losses == pytest.approx(eager, rel=1e-4)
    assert eager_compile_s == [None] * 4
    assert compile_s[0] is None and compile_s[1] is not None and compile_s[1] >= 0
    assert compile_s[2:] == [None, None]
    [event] = ranks.events(0, "compile")
    assert (event["blocks"], event["backend"]) == ("2", "aot_eager")
    assert event["cache"] == str(tmp_path / "compile-cache")
    assert float(ranks.events(0, "compiled")[0]["compile_s"]) == pytest.approx(
        compile_s[1], rel=1e-5
    )
