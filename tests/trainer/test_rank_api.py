"""The rank API (``ringmaster.rank``) in a user's own loop (examples/rank_api_loop.py), on
two real ranks with a fake agent on the control socket: the loop says what it supports,
pauses, checkpoints and stops at one agreed step, restores from the memory tier after its
ranks are killed, checkpoints on a SIGTERM notice before leaving, and runs unchanged
without an agent."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from typing import Any

import msgspec
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
from ringmaster.memory_store import remove_job_ram
from ringmaster.rank.fake_agent import FakeAgent
from tests.trainer.conftest import REPO, free_port
from tests.trainer.zygote import run

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
    # how often the ranks agree follows rank 0's step time, alike on every rank
    every = [[(e["step"], e["steps"]) for e in ranks.events(r, "agree_every")] for r in (0, 1)]
    assert every[0] == every[1], every
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


@pytest.mark.parametrize(
    ("notice", "env"),
    [(signal.SIGTERM, {}), (signal.SIGUSR1, {"SLURM_JOB_ID": "77"})],
    ids=["sigterm", "slurm-usr1"],
)
def test_a_notice_checkpoints_at_one_step_then_the_ranks_leave(
    tmp_path: Path, launch: Any, make_spec: Any, notice: signal.Signals, env: dict[str, str]
) -> None:
    """A SIGTERM that is not the agent's, or inside a Slurm allocation Slurm's SIGUSR1
    warning before the job's end, to one rank."""
    agent = FakeAgent(tmp_path / "agent.sock")
    spec = make_spec(checkpoint={"every_steps": 10_000, "memory_tier": False})
    ranks = launch(spec, socket_path=agent.path, argv=loop(100_000), env=env)
    agent.wait_for(StepDone, lambda m: m.step >= 3)
    ranks.procs[1].send_signal(notice)  # one rank's notice is every rank's
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


def test_a_checkpoint_asked_and_a_notice_during_a_long_phase_are_saved_inside_it(
    tmp_path: Path, launch: Any, make_spec: Any
) -> None:
    """A long evaluation reaches no step boundary: a checkpoint asked for during it is
    written inside it, at the step before it (once: the next boundary does not write it
    again), and a notice during the next one checkpoints there and leaves long before its
    grace; the next attempt resumes from that step, nothing lost."""
    agent = FakeAgent(tmp_path / "agent.sock")
    spec = make_spec(checkpoint={"every_steps": 10_000, "memory_every_steps": 2})
    argv = [str(REPO / "tests" / "trainer" / "long_phase_loop.py"), "8,16", str(tmp_path)]
    grace = {"RINGMASTER_NOTICE_GRACE_S": "600"}  # leaving at the grace would time out
    ranks = launch(spec, socket_path=agent.path, argv=argv, env=grace)
    agent.wait_for(PhaseChanged, lambda m: m.entered and m.step == 8)
    agent.send(ControlAction.CHECKPOINT)
    assert agent.wait_for(Checkpointed).step == 8
    assert not [m for m in agent.of(PhaseChanged) if not m.entered], "saved inside the phase"
    (tmp_path / "eval-8").touch()
    agent.wait_for(PhaseChanged, lambda m: m.entered and m.step == 16)
    assert [m.step for m in agent.of(Checkpointed)] == [8], "the word was carried out once"
    ranks.signal(signal.SIGTERM)  # a preemption: the node's ranks all told
    assert ranks.wait() == [143, 143]
    assert [m.step for m in agent.of(Checkpointed)] == [8, 16]
    again = launch(spec, socket_path=agent.path, argv=argv, env={"RINGMASTER_ATTEMPT": "2"})
    assert agent.wait_for(LoopReady, lambda m: m.resumed_from != "fresh").step == 16
    again.signal(signal.SIGKILL)
    agent.close()


def test_a_notice_during_a_long_phase_of_a_loop_that_saves_itself_is_a_memory_snapshot(
    tmp_path: Path, launch: Any, make_spec: Any
) -> None:
    """Where the framework writes the durable checkpoints, nothing of ours can write one
    inside its phase: the memory tier's snapshot of the step before the phase is taken
    there (copied to the buddy) and the ranks leave; the next attempt resumes from it."""
    agent = FakeAgent(tmp_path / "agent.sock")
    spec = make_spec(checkpoint={"every_steps": 10_000, "memory_every_steps": 5})
    argv = [str(REPO / "tests" / "trainer" / "long_phase_loop.py"), "8", str(tmp_path)]
    argv.append("--loop-saves")
    ranks = launch(
        spec, socket_path=agent.path, argv=argv, env={"RINGMASTER_NOTICE_GRACE_S": "600"}
    )
    agent.wait_for(PhaseChanged, lambda m: m.entered and m.step == 8)
    ranks.signal(signal.SIGTERM)
    assert ranks.wait() == [143, 143]
    assert ranks.events(0, "saved_in_phase")[0]["tier"] == "memory"
    again = launch(spec, socket_path=agent.path, argv=argv, env={"RINGMASTER_ATTEMPT": "2"})
    ready = agent.wait_for(LoopReady, lambda m: m.resumed_from != "fresh")
    assert (ready.resumed_from, ready.step) == ("memory", 8)
    again.signal(signal.SIGKILL)
    agent.close()


def test_the_same_loop_runs_unchanged_without_an_agent(tmp_path: Path, zygote: Any) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGMASTER_")} | {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    code, stderr = run(zygote, loop(5, "--eval-every", "2"), env, tmp_path, 120)
    assert code == 0, stderr
    assert "event=" not in stderr  # nothing of Ringmaster's ran
    assert list(tmp_path.iterdir()) == []  # and nothing was written


MISUSE = {
    "register after restore": (
        "rank.register(model); rank.restore(); rank.register(optimizer=opt)",
        "register() after restore() or step()",
    ),
    "a step that goes backwards": (
        "rank.register(model); rank.restore(); rank.step(3); rank.step(2)",
        "step(2) after step(3): steps must increase",
    ),
    "restore twice": ("rank.restore(); rank.restore()", "restore() called twice"),
    "a phase without a name": ("rank.restore()\nwith rank.phase(''): pass", "phase(''): name it"),
    "something that is not state": ("rank.register(lr=0.1)", "a float has no state_dict()"),
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_bad_use_is_one_line_naming_it_and_leaves_the_checkpoints_alone(
    case: str, tmp_path: Path, make_spec: Any, zygote: Any
) -> None:
    code, said = MISUSE[case]
    spec_path = tmp_path / "spec.json"
    spec_path.write_bytes(msgspec.json.encode(make_spec()))
    job = f"misuse-{uuid.uuid4().hex[:8]}"
    script = (
        "import sys, torch\nfrom ringmaster import rank\n"
        "model = torch.nn.Linear(2, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "try:\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + "except rank.RankApiError as e:\n"
        "    print(e, file=sys.stderr); sys.exit(3)\n"
    )
    env = {
        **os.environ,
        "RINGMASTER_JOB_SPEC": str(spec_path),
        "RINGMASTER_JOB_ID": job,
        "RINGMASTER_ATTEMPT": "1",  # a first attempt: nothing of another run's is restored
        "RINGMASTER_WORKDIR": str(tmp_path),
        "PYTHONPATH": str(REPO),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    (tmp_path / "misuse.py").write_text(script)
    try:
        code, stderr = run(zygote, [str(tmp_path / "misuse.py")], env, tmp_path, 120)
    finally:
        remove_job_ram(job)
    assert code == 3, stderr
    named = [line for line in stderr.splitlines() if said in line]
    assert "Traceback" not in stderr and len(named) == 1, stderr
    assert not list((tmp_path / "ckpt").glob("step-*")), "nothing was written"
