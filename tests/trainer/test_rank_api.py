"""The rank API (``ringmaster.rank``) in a user's own loop (examples/rank_api_loop.py), on
two real ranks with a fake agent on the control socket: the loop says what it supports,
pauses, checkpoints and stops at one agreed step, restores from the memory tier after its
ranks are killed, checkpoints on a SIGTERM notice before leaving, and runs unchanged
without an agent."""

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
    Reaction,
    Resumed,
    StepDone,
)
from tests.trainer.conftest import REPO, free_port
from trainer.fake_agent import FakeAgent

pytestmark = pytest.mark.slow
LOOP = str(REPO / "examples" / "rank_api_loop.py")


def loop(steps: int, *extra: str) -> list[str]:
    return [LOOP, "--steps", str(steps), *extra]


def test_a_user_loop_says_what_it_supports_and_pauses_checkpoints_and_stops_together(
    tmp_path: Path, launch: Any, make_spec: Any
) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    spec = make_spec(checkpoint={"every_steps": 10_000, "memory_every_steps": 5})
    ranks = launch(spec, socket_path=agent.path, argv=loop(100_000))
    ready = agent.wait_for(LoopReady)
    assert ready.framework == "custom" and ready.resumed_from == "fresh" and ready.step == 0
    assert set(ready.reactions) == set(Reaction)
    agent.wait_for(StepDone, lambda m: m.step >= 3)
    agent.send(ControlAction.PAUSE)
    paused = agent.wait_for(Paused)
    # no rank steps while paused: rank 0 reported nothing past the paused step
    agent.send(ControlAction.CHECKPOINT)  # honoured while paused, at the paused step
    assert agent.wait_for(Checkpointed).step == paused.step
    assert max(m.step for m in agent.of(StepDone)) == paused.step
    agent.send(ControlAction.RESUME)
    assert agent.wait_for(Resumed).step == paused.step
    agent.wait_for(StepDone, lambda m: m.step >= paused.step + 3)
    agent.send(ControlAction.STOP)
    assert ranks.wait() == [0, 0]
    finished = agent.wait_for(Finished)
    assert finished.outcome == "stopped"
    stopped = [e for e in ranks.events(0, "checkpoint_staged") if int(e["step"]) == finished.step]
    assert stopped, "the stop's checkpoint is at the step the ranks stopped at"
    for rank in (0, 1):  # every rank acted at the same steps
        assert ranks.events(rank, "paused")[0]["step"] == str(paused.step)
        assert ranks.events(rank, "finished")[0]["step"] == str(finished.step)
    agent.close()


def test_killed_ranks_restore_from_memory_a_few_steps_back(
    tmp_path: Path, launch: Any, make_spec: Any
) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    spec = make_spec(checkpoint={"every_steps": 10_000, "memory_every_steps": 3})
    first = launch(spec, socket_path=agent.path, argv=loop(100_000))
    agent.wait_for(StepDone, lambda m: (m.memory_step or 0) >= 6)
    first.signal(signal.SIGKILL)
    first.wait()
    reached = max(m.step for m in agent.of(StepDone))
    again = launch(
        spec, socket_path=agent.path, argv=loop(100_000), env={"RINGMASTER_ATTEMPT": "2"}
    )
    ready = agent.wait_for(LoopReady, lambda m: m.resumed_from == "memory")
    assert 6 <= ready.step <= reached and reached - ready.step <= 4
    for rank in (0, 1):
        line = again.wait_for_event(rank, "resumed_from")
        assert line["tier"] == "memory" and int(line["step"]) == ready.step
    agent.wait_for(StepDone, lambda m: m.step == ready.step + 1)
    again.signal(signal.SIGKILL)
    agent.close()


def test_a_sigterm_notice_checkpoints_at_one_step_then_the_ranks_leave(
    tmp_path: Path, launch: Any, make_spec: Any
) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    spec = make_spec(checkpoint={"every_steps": 10_000, "memory_tier": False})
    ranks = launch(spec, socket_path=agent.path, argv=loop(100_000))
    agent.wait_for(StepDone, lambda m: m.step >= 3)
    ranks.procs[1].send_signal(signal.SIGTERM)  # one rank's notice is every rank's
    assert ranks.wait() == [143, 143]
    saved = agent.wait_for(Checkpointed)
    last = max(m.step for m in agent.of(StepDone))
    assert saved.step == last, "nothing trained past the notice's checkpoint is lost"
    assert not agent.of(Finished)
    again = launch(spec, socket_path=agent.path, argv=loop(100_000))
    resumed = agent.wait_for(LoopReady, lambda m: m.resumed_from == "durable")
    assert resumed.step == saved.step
    again.signal(signal.SIGKILL)
    agent.close()


def test_the_same_loop_runs_unchanged_without_an_agent(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")} | {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, *loop(5, "--eval-every", "2")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "event=" not in done.stderr  # nothing of Ringmaster's ran
    assert list(tmp_path.iterdir()) == []  # and nothing was written
