"""The Hugging Face integration (``ringmaster.integrations.hf``) in examples/hf_trainer.py,
a ``Trainer`` script as its documentation writes it plus two lines, on two real ranks with
a fake agent: it says what it supports, pauses at one step, writes the ``Trainer``'s own
checkpoint at the step every rank agrees on and reports it, stops after that checkpoint,
and the same script without its two lines runs as before and opens nothing. Restores from
the memory tier are tested on a cluster (tests/e2e/test_integrations.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from proto.progress import (
    Checkpointed,
    ControlAction,
    Finished,
    LoopReady,
    Paused,
    Reaction,
    Resumed,
    StepDone,
)
from ringmaster.rank.fake_agent import FakeAgent
from tests.trainer.conftest import REPO, free_port
from tests.trainer.zygote import run

pytestmark = pytest.mark.slow
SCRIPT = REPO / "examples" / "hf_trainer.py"
MARK = "# ringmaster"


def integration_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.rstrip().endswith(MARK)]


def unmodified(path: Path, into: Path) -> Path:
    """The script without its integration lines: the user's own, as it was."""
    kept = [line for line in path.read_text().splitlines() if not line.rstrip().endswith(MARK)]
    into.write_text("\n".join(kept) + "\n")
    return into


def argv(out: Path, steps: int = 100_000, *extra: str) -> list[str]:
    return [str(SCRIPT), "--out", str(out), "--steps", str(steps), *extra]


def test_the_integration_is_two_lines() -> None:
    lines = integration_lines(SCRIPT)
    assert len(lines) == 2, lines


def test_pause_checkpoint_and_stop_at_one_step_through_the_trainer_s_own_save(
    tmp_path: Path, launch: Any, make_spec: Any
) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    out = tmp_path / "out"
    spec = make_spec(checkpoint={"memory_every_steps": 5})
    ranks = launch(spec, socket_path=agent.path, argv=argv(out, 100_000, "--save-steps", "100000"))
    ready = agent.wait_for(LoopReady, timeout=120)
    assert ready.framework == "hf" and set(ready.reactions) == set(Reaction)
    agent.wait_for(StepDone, lambda m: m.step >= 3)
    agent.send(ControlAction.PAUSE)
    paused = agent.wait_for(Paused)
    assert max(m.step for m in agent.of(StepDone)) == paused.step
    agent.send(ControlAction.RESUME)
    assert agent.wait_for(Resumed).step == paused.step
    agent.send(ControlAction.CHECKPOINT)
    saved = agent.wait_for(Checkpointed)
    assert saved.path == str(out / f"checkpoint-{saved.step}")
    assert (out / f"checkpoint-{saved.step}" / "trainer_state.json").exists()
    agent.send(ControlAction.STOP)
    assert ranks.wait(120) == [0, 0]
    finished = agent.wait_for(Finished)
    assert finished.outcome == "stopped"
    assert (out / f"checkpoint-{finished.step}").is_dir(), "the stop's checkpoint is the Trainer's"
    last = agent.of(Checkpointed)[-1]
    assert last.step == finished.step
    agent.close()


def test_the_script_without_its_two_lines_runs_as_it_did(tmp_path: Path, zygote: Any) -> None:
    plain = unmodified(SCRIPT, tmp_path / "plain.py")
    text = plain.read_text()
    assert "from ringmaster" not in text and "RingmasterCallback" not in text
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")} | {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    for script in (plain, SCRIPT):  # with its lines too: outside a job they do nothing
        out = tmp_path / f"out-{script.stem}"
        argv = [str(script), "--out", str(out), "--steps", "4", "--save-steps", "2"]
        code, stderr = run(zygote, argv, {**env, "PYTHONPATH": str(REPO)}, tmp_path, 180)
        assert code == 0, stderr[-2000:]
        assert "event=" not in stderr
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4"]
