"""Two real ranks over gloo: training, resume, crash safety, and control through the agent
socket. Each test launches ``python -m trainer.worker`` processes (see conftest)."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dcp_files import read_dcp

from proto.job import JobSpec
from proto.progress import Checkpointed, Finished, Paused, Resumed, StepDone
from ringmaster.procs import wait_until
from ringmaster.rank import durable
from ringmaster.rank.checkpoint import default_staging_dir
from ringmaster.rank.coordination import Coordination, find_resumable, load_file
from ringmaster.rank.dcp_async import DcpState
from ringmaster.rank.fake_agent import FakeAgent
from tests.waits import until
from trainer.flops import model_flops_per_token
from trainer.presets import get_preset

pytestmark = pytest.mark.slow
MakeSpec = Callable[..., JobSpec]


def traces(workdir: Path, rank: int) -> list[dict[str, Any]]:
    lines = (workdir / f"trace-rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_fp8_training_loss_falls_on_two_ranks(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    # tiny's linears are too small for float8 to pay ("auto" keeps them): force it
    fp8 = {"precision": "fp8", "fp8_recipe": "tensorwise"}
    spec = make_spec(train={**fp8, "steps": 30, "micro_batch_size": 4, "seq_len": 64})
    ranks = launch(spec, socket_path=agent.path)
    assert ranks.wait() == [0, 0], ranks.log(0)
    steps = agent.of(StepDone)
    losses = [m.loss for m in steps]
    assert len(losses) == 30
    # the FLOPs are known, the CPU's peak is not (no MFU), and nothing was compiled
    flops = model_flops_per_token(get_preset("tiny"), 64)
    assert all(m.model_flops_per_token == flops for m in steps)
    assert all(m.mfu is None and m.compile_s is None for m in steps)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    for rank in (0, 1):
        assert ranks.events(rank, "model")[0]["float8_linears"] == "8"
    finished = agent.wait_for(Finished)
    assert (finished.step, finished.outcome) == (30, "completed")
    agent.close()


def test_resume_is_bit_identical_to_an_uninterrupted_run(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    trace_a, trace_b = tmp_path / "interrupted", tmp_path / "straight"
    trace_a.mkdir()
    trace_b.mkdir()
    # interrupted: 6 steps (checkpoints at 3 and 6), then a fresh launch continues to 10
    first = make_spec(train={"steps": 6}, checkpoint={"every_steps": 3, "dir": "a"})
    env = {"RINGMASTER_TEST_TRACE": str(trace_a)}
    assert launch(first, job_id="first-0a1b2c", env=env).wait() == [0, 0]
    second = make_spec(train={"steps": 10}, checkpoint={"every_steps": 3, "dir": "a"})
    resumed = launch(second, job_id="second-3d4e5f", env=env)
    assert resumed.wait() == [0, 0], resumed.log(0)
    # each manifest names the job that wrote it, and the resume says whose it continued
    event = resumed.events(1, "resumed_from")[0]
    assert (event["step"], event["job"]) == ("6", "first-0a1b2c")
    manifest = durable.read_manifest(tmp_path / "a" / "step-9")
    assert manifest is not None and manifest.job == "second-3d4e5f"
    # uninterrupted: 10 steps in one go
    straight = make_spec(train={"steps": 10}, checkpoint={"every_steps": 3, "dir": "b"})
    assert launch(straight, env={"RINGMASTER_TEST_TRACE": str(trace_b)}).wait() == [0, 0]

    for rank in (0, 1):
        a, b = traces(trace_a, rank), traces(trace_b, rank)
        assert [t["step"] for t in a] == list(range(10))  # trace steps are 0-based
        assert [t["ids"] for t in a] == [t["ids"] for t in b]  # same samples after resume
        assert [t["loss"] for t in a] == [t["loss"] for t in b]  # bit-identical losses
    final_a = read_dcp(tmp_path / "a" / "step-10", tmp_path)
    final_b = read_dcp(tmp_path / "b" / "step-10", tmp_path)
    assert final_a["model"].keys() == final_b["model"].keys()
    for name, tensor in final_b["model"].items():
        assert torch.equal(final_a["model"][name], tensor), name
    state_a, state_b = final_a["optimizer"]["state"], final_b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys() and state_a
    assert all(torch.equal(state_a[k]["exp_avg_sq"], state_b[k]["exp_avg_sq"]) for k in state_a)
    # DCP reshards on load, so a smaller world (a node drained) resumes the same state
    alone = make_spec(train={"steps": 11}, checkpoint={"every_steps": 3, "dir": "b"})
    ranks = launch(alone, world_size=1)
    assert ranks.wait() == [0], ranks.log(0)
    assert ranks.events(0, "resumed_from")[0]["step"] == "10"
    assert durable.read_manifest(tmp_path / "b" / "step-11") is not None


def test_kill_during_persist_keeps_previous_checkpoint(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    root = tmp_path / "ckpt"
    durable_only = {"memory_tier": False}  # a newer memory snapshot would be resumed instead
    assert launch(make_spec(train={"steps": 3}, checkpoint=durable_only)).wait() == [0, 0]
    assert durable.read_latest(root) == "step-3"
    # the next run's final persist stalls after writing its shards; kill -9 it there
    ranks = launch(
        make_spec(train={"steps": 6}, checkpoint=durable_only),
        env={"RINGMASTER_TEST_PERSIST_DELAY_S": "60"},
    )
    # each rank writes its step/RNG file once its DCP files are written and fsynced
    shards = [root / "step-6" / durable.trainer_file(r) for r in (0, 1)]

    def written() -> bool:
        assert all(p.poll() is None for p in ranks.procs), ranks.log(0)[-3000:]
        return all(p.exists() for p in shards)

    until(written, 60, "both ranks' step-6 shards", lambda: [p.exists() for p in shards])
    ranks.signal(signal.SIGKILL)
    assert ranks.wait() == [-9, -9]
    assert durable.read_latest(root) == "step-3"
    assert durable.read_manifest(root / "step-6") is None
    assert (root / "step-6" / "dcp" / ".metadata").exists()  # written, never sealed
    found = find_resumable(root, Coordination(), lambda m: [*DcpState.files_for(m)])
    assert found is not None and found[1] == root / "step-3"
    assert load_file(root / "step-3" / "trainer-rank-0.pt")["step"] == 3
    # a fresh launch resumes from step 3 and completes, sealing step 6 this time
    again = launch(make_spec(train={"steps": 6}, checkpoint=durable_only))
    assert again.wait() == [0, 0]
    assert again.events(0, "resumed_from")[0]["step"] == "3"
    assert durable.read_latest(root) == "step-6"


def test_training_continues_while_a_checkpoint_is_unserialised(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    """The loop waits for a snapshot, never for the persist: with every persist held
    before it seals anything, the ranks still train past the checkpoint."""
    agent = FakeAgent(tmp_path / "agent.sock")
    gate = tmp_path / "gate"
    # (a memory snapshot waits for the durable persist before it: the tier is off here)
    spec = make_spec(train={"steps": 8}, checkpoint={"every_steps": 4, "memory_tier": False})
    ranks = launch(spec, socket_path=agent.path, env={"RINGMASTER_TEST_PERSIST_GATE": str(gate)})
    agent.wait_for(StepDone, lambda m: m.step >= 7)
    for rank in (0, 1):
        staged = ranks.events(rank, "checkpoint_staged")[0]
        assert (staged["step"], staged["in_memory"]) == ("4", "2")  # DCP state + step/RNG
    # steps 5-7 ran while step 4's checkpoint was still only in memory
    staging = default_staging_dir(launch.job_id, tmp_path)
    assert not [p for p in (*tmp_path.rglob("*.pt"), *staging.rglob("*")) if p.is_file()]
    assert not agent.of(Checkpointed)
    gate.touch()
    finished = agent.wait_for(Finished)
    assert ranks.wait() == [0, 0], ranks.log(0)
    assert (finished.step, finished.outcome) == (8, "completed")
    assert [m.step for m in agent.of(Checkpointed)] == [4, 8]
    assert durable.read_latest(tmp_path / "ckpt") == "step-8"
    found = find_resumable(tmp_path / "ckpt", Coordination(), DcpState.files_for)
    assert found is not None and found[1].name == "step-8"
    assert load_file(tmp_path / "ckpt" / "step-4" / "trainer-rank-1.pt")["step"] == 4
    agent.close()


def test_pause_holds_every_rank_then_resume_completes(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    ranks = launch(make_spec(train={"steps": 200}), socket_path=agent.path)
    agent.wait_for(StepDone, lambda m: m.step >= 2)
    agent.send("pause")
    paused = agent.wait_for(Paused)
    held = paused.step
    assert 2 <= held < 200
    assert [ranks.wait_for_event(r, "paused")["step"] for r in (0, 1)] == [str(held)] * 2
    # an agent restart while paused: the link reconnects and control still works
    agent.drop_connection()
    agent.send("checkpoint")
    ckpt = agent.wait_for(Checkpointed)
    assert ckpt.step == held
    assert durable.read_latest(tmp_path / "ckpt") == f"step-{held}"
    # nobody stepped while paused (the checkpoint round-trip above took several polls)
    assert max(m.step for m in agent.of(StepDone)) == held
    assert all(r.poll() is None for r in ranks.procs)
    agent.send("resume")
    resumed = agent.wait_for(Resumed)
    assert resumed.step == held
    finished = agent.wait_for(Finished)
    assert (finished.step, finished.outcome) == (200, "completed")
    assert ranks.wait() == [0, 0]
    for rank in (0, 1):
        assert ranks.events(rank, "resumed")[0]["step"] == str(held)
        steps = [int(e["step"]) for e in ranks.events(rank, "step")]
        assert steps == list(range(1, 201))
    agent.close()


def test_stop_checkpoints_and_exits_zero(tmp_path: Path, launch: Any, make_spec: MakeSpec) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    ranks = launch(make_spec(train={"steps": 100_000}), socket_path=agent.path)
    agent.wait_for(StepDone, lambda m: m.step >= 2)
    agent.send("stop")
    finished = agent.wait_for(Finished)
    assert ranks.wait() == [0, 0]
    assert finished.outcome == "stopped"
    ckpt = agent.wait_for(Checkpointed)
    assert ckpt.step == finished.step
    root = tmp_path / "ckpt"
    assert durable.read_latest(root) == f"step-{finished.step}"
    manifest = durable.read_manifest(root / f"step-{finished.step}")
    assert manifest is not None and sorted(manifest.ranks) == ["0", "1"]
    for rank, files in manifest.ranks.items():
        # each rank lists its own DCP files and its step/RNG; rank 0 also DCP's index
        dcp_files = [f for f in files if f.startswith("dcp/__")]
        assert dcp_files and all(f.startswith(f"dcp/__{rank}_") for f in dcp_files), files
        assert f"trainer-rank-{rank}.pt" in files
        assert ("dcp/.metadata" in files) == (rank == "0")
    for rank in (0, 1):
        assert ranks.events(rank, "finished")[0]["outcome"] == "stopped"
    agent.close()


def test_sigterm_exits_quickly_nonzero_and_drops_staged_copies(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    spec = make_spec(train={"steps": 100_000}, checkpoint={"every_steps": 2})
    ranks = launch(spec, socket_path=agent.path)
    agent.wait_for(Checkpointed)
    staging = default_staging_dir(launch.job_id, tmp_path)
    # A rank re-stages every second step (its dir is dropped and made again), so one look
    # may fall between the two: wait until both ranks' copies are seen at once.
    wait_until(lambda: sorted(p.name for p in staging.iterdir()) == ["rank-0", "rank-1"], 15)
    ranks.signal(signal.SIGTERM)
    assert ranks.wait(timeout=10) == [143, 143]  # quickly: within 10 s
    assert not staging.exists()
    agent.close()
