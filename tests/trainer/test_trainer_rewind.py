"""Numeric faults and stragglers on two real gloo ranks, rehearsed through the simulated
node's knobs file (``RINGMASTER_SIM_KNOBS``) as ``coordinatorctl inject`` writes it."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from proto.faults import SimKnobs
from proto.job import JobSpec
from proto.progress import Checkpointed, Finished, Rewound, StepDone, Stragglers
from ringmaster.rank.coordination import load_file
from ringmaster.rank.fake_agent import FakeAgent
from ringmaster.rundir import SIM_KNOBS_ENV

pytestmark = pytest.mark.slow
MakeSpec = Callable[..., JobSpec]


def write_knobs(path: Path, **knobs: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(SimKnobs(**knobs)))
    tmp.replace(path)


def simulated(knobs: Path, **extra: str) -> dict[str, str]:
    return {"RINGMASTER_SIMULATED": "1", SIM_KNOBS_ENV: str(knobs), **extra}


def traces(workdir: Path, rank: int) -> list[dict[str, Any]]:
    lines = (workdir / f"trace-rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def evidence(log: str) -> str:
    """The rank's one-line reason for exiting 1."""
    (line,) = [line for line in log.splitlines() if line.startswith("trainer: numeric fault")]
    return line


def nan_loss_rewind(
    tmp_path: Path, launch: Any, make_spec: MakeSpec, engine: str, steps: int
) -> None:
    """A nan-loss request mid-run: both ranks rewind to the newest checkpoint at the same
    step, rank 0 reports it, and the run completes on data it never saw before."""
    agent = FakeAgent(tmp_path / "agent.sock")
    knobs, trace = tmp_path / "sim-knobs.json", tmp_path / "trace"
    trace.mkdir()
    write_knobs(knobs, nan_loss=2)  # requests from before the ranks started never fire
    spec = make_spec(train={"engine": engine, "steps": steps}, checkpoint={"every_steps": 5})
    env = simulated(knobs, RINGMASTER_TEST_TRACE=str(trace))
    ranks = launch(spec, socket_path=agent.path, env=env)
    agent.wait_for(Checkpointed, lambda m: m.step >= 5)
    write_knobs(knobs, nan_loss=3)
    assert ranks.wait() == [0, 0], ranks.log(0) + ranks.log(1)

    (rewound,) = agent.of(Rewound)
    newest = (rewound.from_step - 1) // 5 * 5  # the newest checkpoint before the fault
    assert rewound.step == newest >= 5 and rewound.reason == "non-finite loss nan"
    assert rewound.ranks == [0]  # the knob poisons its node's first rank alone
    assert (rewound.skip_from, rewound.skip_to) == (rewound.step, rewound.from_step)
    for rank in (0, 1):  # both ranks, at the same step
        (logged,) = ranks.events(rank, "rewound")
        assert logged["step"] == str(rewound.step)
        assert logged["from_step"] == str(rewound.from_step)
    assert len(ranks.events(0, "sim_nan_loss")) == 1 and not ranks.events(1, "sim_nan_loss")
    # the checkpoint gone back to is not taken again (nor announced twice)
    assert [m.step for m in agent.of(Checkpointed)].count(rewound.step) == 1
    losses = [m.loss for m in agent.of(StepDone)]
    assert all(math.isfinite(loss) for loss in losses)  # the faulty step is never reported
    finished = agent.wait_for(Finished)
    assert (finished.step, finished.outcome) == (steps, "completed")
    skipped = rewound.from_step - rewound.step
    for rank in (0, 1):
        record = traces(trace, rank)
        assert len(record) == steps + skipped  # steps [step, from_step) ran twice
        ids = [i for r in record for i in r["ids"]]
        assert len(ids) == len(set(ids))  # but never on the same samples
        assert not math.isfinite(record[rewound.from_step - 1]["loss"])
    # the offset is in every later checkpoint, so a restart keeps skipping
    final = load_file(tmp_path / "ckpt" / f"step-{steps}" / "trainer-rank-0.pt")
    assert final["data_offset"] == skipped
    agent.close()


def test_a_nan_loss_rewinds_every_rank_and_skips_the_window(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    nan_loss_rewind(tmp_path, launch, make_spec, engine="ddp", steps=40)


def test_a_nan_loss_rewinds_deepspeed_too(tmp_path: Path, launch: Any, make_spec: MakeSpec) -> None:
    nan_loss_rewind(tmp_path, launch, make_spec, engine="deepspeed", steps=20)


def test_a_fault_that_keeps_coming_back_ends_the_rank_one_past_the_coordinators_budget(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    """max_rewinds=1: the coordinator judges the second time in a row; the rank rewinds it
    too (its report is the coordinator's evidence) and gives up only at the third."""
    agent = FakeAgent(tmp_path / "agent.sock")
    knobs = tmp_path / "sim-knobs.json"
    spec = make_spec(train={"steps": 200}, checkpoint={"every_steps": 3}, policy={"max_rewinds": 1})
    ranks = launch(spec, socket_path=agent.path, env=simulated(knobs))
    agent.wait_for(Checkpointed, lambda m: m.step >= 3)
    write_knobs(knobs, nan_loss=3)  # three requests: each step after a rewind faults again
    assert ranks.wait() == [1, 1]
    assert len(agent.of(Rewound)) == 2
    for rank in (0, 1):
        assert len(ranks.events(rank, "rewound")) == 2
        line = evidence(ranks.log(rank))
        assert "(non-finite loss nan): 3 times in a row within 10 steps" in line
        assert "policy.max_rewinds=1" in line
    assert not agent.of(Finished)
    agent.close()


def test_a_fault_with_no_checkpoint_to_go_back_to_fails(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    knobs = tmp_path / "sim-knobs.json"
    ranks = launch(make_spec(train={"steps": 500}), socket_path=agent.path, env=simulated(knobs))
    agent.wait_for(StepDone, lambda m: m.step >= 2)
    write_knobs(knobs, nan_loss=1)
    assert ranks.wait() == [1, 1]
    for rank in (0, 1):
        line = evidence(ranks.log(rank))
        assert line.endswith("(non-finite loss nan) and no durable checkpoint to rewind to")
    assert not agent.of(Rewound)
    agent.close()


def test_a_slow_rank_shows_in_stragglers(tmp_path: Path, launch: Any, make_spec: MakeSpec) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    fast, slow = tmp_path / "node-0.json", tmp_path / "node-1.json"
    write_knobs(slow, slow=3.0)
    spec = make_spec(
        train={"steps": 30, "micro_batch_size": 4, "seq_len": 64},
        policy={"straggler_window_steps": 5},
    )
    per_rank = {0: simulated(fast), 1: simulated(slow)}  # as if on two nodes
    ranks = launch(spec, socket_path=agent.path, per_rank_env=per_rank)
    assert ranks.wait() == [0, 0], ranks.log(1)
    reports = agent.of(Stragglers)
    assert [r.step for r in reports] == [5, 10, 15, 20, 25, 30]
    assert all(r.window_steps == 5 and len(r.rank_step_s) == 2 for r in reports)
    # rank 0 waits for rank 1 every step, but its own compute time does not show that:
    # rank 1 stands out by more than the policy's straggler ratio (its knob makes it 3x
    # slower; the other work sharing this host's cores narrows that, never below 1.5)
    ratio = statistics.median(r.rank_step_s[1] / r.rank_step_s[0] for r in reports)
    threshold = spec.policy.straggler_ratio
    assert threshold < ratio < 4.5, [r.rank_step_s for r in reports]
    agent.close()
