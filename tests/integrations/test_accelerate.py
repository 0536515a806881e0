"""The accelerate integration (``ringmaster.integrations.accelerate``) in
examples/accelerate_loop.py, an accelerate loop as its documentation writes one plus six
lines, on two real ranks with a fake agent: it says what it supports, pauses at one step,
writes accelerate's own ``save_state`` checkpoint at the step every rank agrees on and
reports it, stops after that checkpoint through accelerate's trigger, checkpoints on a
preemption notice before leaving, and the same script without its six lines runs as before
and opens nothing. Restores from the memory tier are tested on a cluster
(tests/e2e/test_integrations.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proto.progress import (
    Checkpointed,
    ControlAction,
    Finished,
    LoopReady,
    Paused,
    PhaseChanged,
    Reaction,
    Resumed,
    StepDone,
)
from ringmaster.rank.fake_agent import FakeAgent
from tests.trainer.conftest import REPO, free_port

pytestmark = pytest.mark.slow
SCRIPT = REPO / "examples" / "accelerate_loop.py"
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


def test_the_integration_is_six_lines() -> None:
    lines = integration_lines(SCRIPT)
    assert len(lines) == 6, lines


def test_pause_checkpoint_and_stop_at_one_step_through_accelerate_s_own_save(
    tmp_path: Path, launch: Any, make_spec: Any
) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    out = tmp_path / "out"
    spec = make_spec(checkpoint={"memory_every_steps": 5})
    script = argv(out, 100_000, "--save-steps", "100000", "--eval-steps", "4")
    ranks = launch(spec, socket_path=agent.path, argv=script)
    ready = agent.wait_for(LoopReady, timeout=120)
    assert ready.framework == "accelerate" and set(ready.reactions) == set(Reaction)
    assert ready.resumed_from == "fresh"
    evaluated = agent.wait_for(PhaseChanged, lambda m: m.name == "eval" and not m.entered)
    assert evaluated.step == 4
    agent.send(ControlAction.PAUSE)
    paused = agent.wait_for(Paused)
    assert max(m.step for m in agent.of(StepDone)) == paused.step
    agent.send(ControlAction.RESUME)
    assert agent.wait_for(Resumed).step == paused.step
    agent.send(ControlAction.CHECKPOINT)
    saved = agent.wait_for(Checkpointed)
    assert saved.step > paused.step
    assert saved.path == str(out / f"checkpoint-{saved.step}")
    assert (out / f"checkpoint-{saved.step}" / "model.safetensors").exists()
    saving = [m for m in agent.of(PhaseChanged) if m.name == "save" and not m.entered]
    assert [m.step for m in saving] == [saved.step], "the save is a phase, not a step"
    agent.send(ControlAction.STOP)
    assert ranks.wait(120) == [0, 0]
    finished = agent.wait_for(Finished)
    assert finished.outcome == "stopped"
    assert max(m.step for m in agent.of(StepDone)) == finished.step
    stop_checkpoint = out / f"checkpoint-{finished.step}"
    assert (stop_checkpoint / "random_states_1.pkl").exists(), "every rank wrote its part"
    last = agent.of(Checkpointed)[-1]
    assert last.step == finished.step and last.path == str(stop_checkpoint)
    agent.close()


def test_a_sigterm_notice_writes_accelerate_s_checkpoint_then_the_ranks_leave(
    tmp_path: Path, launch: Any, make_spec: Any
) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    out = tmp_path / "out"
    spec = make_spec(checkpoint={"memory_every_steps": 5})
    ranks = launch(spec, socket_path=agent.path, argv=argv(out, 100_000, "--save-steps", "100000"))
    agent.wait_for(StepDone, lambda m: m.step >= 3, timeout=120)
    ranks.signal(signal.SIGTERM)  # the node's preemption: every rank's notice
    assert ranks.wait(120) == [143, 143]
    saved = agent.wait_for(Checkpointed)
    assert saved.step == max(m.step for m in agent.of(StepDone)), "nothing trained is lost"
    assert saved.path == str(out / f"checkpoint-{saved.step}")
    assert (out / f"checkpoint-{saved.step}" / "model.safetensors").exists()
    agent.close()


def test_the_script_without_its_six_lines_runs_as_it_did(tmp_path: Path) -> None:
    plain = unmodified(SCRIPT, tmp_path / "plain.py")
    text = plain.read_text()
    assert "from ringmaster" not in text and "Ringmaster(" not in text and "@phase" not in text
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")} | {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }

    def run(script: Path, out: Path, steps: int) -> str:
        command = [sys.executable, str(script), "--out", str(out), "--steps", str(steps)]
        done = subprocess.run(
            [*command, "--save-steps", "2", "--eval-steps", "3"],
            cwd=tmp_path,
            env={**env, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "event=" not in done.stderr
        return done.stdout

    as_it_was = run(plain, tmp_path / "out-plain", 6)
    assert sorted(p.name for p in (tmp_path / "out-plain").iterdir()) == [
        f"checkpoint-{s}" for s in (2, 4, 6)
    ]
    # with its lines too, resuming from its own checkpoint: outside a job they do nothing
    out = tmp_path / "out"
    first, then = run(SCRIPT, out, 4), run(SCRIPT, out, 6)
    assert then.startswith("resumed from checkpoint-4\n")
    assert sorted(p.name for p in out.iterdir()) == [f"checkpoint-{s}" for s in (2, 4, 6)]
    assert first + then.partition("\n")[2] == as_it_was, "the same evaluation losses"
