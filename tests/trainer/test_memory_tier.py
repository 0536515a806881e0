"""The memory tier on real ranks: snapshots in RAM on the rank's node and its buddy's,
restored after a node's loss to the bit."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer_deepspeed import MakeSpec, checkpoint_tensors

from proto.job import memory_store_name
from ringmaster.memory_store import MemoryStore

pytestmark = pytest.mark.slow

SHM = Path("/dev/shm")
ZERO1 = {"engine": "deepspeed", "zero_stage": 1, "precision": "fp32"}


def node_env(*nodes: str) -> dict[int, dict[str, str]]:
    return {rank: {"RINGMASTER_NODE": node} for rank, node in enumerate(nodes)}


def sealed_step(job_id: str, node: str) -> int | None:
    steps = MemoryStore(SHM / memory_store_name(job_id) / node).sealed()
    return max(steps) if steps else None


def assert_same_state(got: Path, want: Path) -> None:
    """Every tensor of two DeepSpeed step dirs equal, bit for bit."""
    found, expected = checkpoint_tensors(got), checkpoint_tensors(want)
    assert found.keys() == expected.keys() and len(found) > 10
    for key, value in found.items():
        assert torch.equal(value, expected[key]), key


def truth_and_lost_node(launch: Any, make_spec: MakeSpec, job: str) -> int:
    """The truth (the job uninterrupted, a durable checkpoint of every step, in
    ``ckpt``), then ``job`` on node-a and node-b with memory snapshots every step and no
    durable one, killed with node-b's RAM once node-a holds step 5 or later: that step."""
    truth = make_spec(train={**ZERO1, "steps": 40}, checkpoint={"every_steps": 1, "keep": 40})
    ranks = launch(truth, job_id=f"{job}-truth", per_rank_env=node_env("node-a", "node-b"))
    assert ranks.wait() == [0, 0], ranks.log(0)
    spec = make_spec(
        train={**ZERO1, "steps": 40},
        checkpoint={"every_steps": 1000, "memory_every_steps": 1, "dir": job},
    )
    ranks = launch(spec, job_id=job, per_rank_env=node_env("node-a", "node-b"))
    deadline = time.monotonic() + 120
    while (sealed_step(job, "node-a") or 0) < 5:
        assert time.monotonic() < deadline and ranks.procs[0].poll() is None, ranks.log(0)
        time.sleep(0.05)
    ranks.signal(signal.SIGKILL)  # node-b is lost, and rank 0 with it (its world is gone)
    ranks.wait(30)
    shutil.rmtree(SHM / memory_store_name(job) / "node-b")  # node-b's RAM went with it
    step = sealed_step(job, "node-a")
    assert step is not None and step >= 5
    return step


def test_a_lost_node_is_restored_from_its_buddy_to_the_bit(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    job = "faulted"
    step = truth_and_lost_node(launch, make_spec, job)
    # rank 1 comes back on a new node: its shard only exists as rank 0's buddy copy
    again = make_spec(
        train={**ZERO1, "steps": step},
        checkpoint={"every_steps": 1000, "memory_every_steps": 1, "dir": "faulted"},
    )
    ranks = launch(again, job_id=job, per_rank_env=node_env("node-a", "node-c"))
    assert ranks.wait() == [0, 0], ranks.log(1)
    for rank in (0, 1):
        resumed = ranks.events(rank, "resumed_from")
        assert resumed and resumed[0]["tier"] == "memory" and resumed[0]["step"] == str(step)
    assert_same_state(tmp_path / "faulted" / f"step-{step}", tmp_path / "ckpt" / f"step-{step}")
    # a clean end gives the RAM back
    assert not (SHM / memory_store_name(job)).exists()


def test_without_a_newer_snapshot_the_durable_checkpoint_is_resumed(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    spec = make_spec(train={**ZERO1, "steps": 6}, checkpoint={"every_steps": 3})
    ranks = launch(spec, per_rank_env=node_env("node-a", "node-b"))
    assert ranks.wait() == [0, 0], ranks.log(0)
    assert any(e.get("memory_snapshots") for e in ranks.events(0, "finished"))
    longer = make_spec(train={**ZERO1, "steps": 8}, checkpoint={"every_steps": 3})
    ranks = launch(longer, per_rank_env=node_env("node-a", "node-b"))
    assert ranks.wait() == [0, 0], ranks.log(0)
    resumed = ranks.events(0, "resumed_from")
    assert resumed[0]["tier"] == "durable" and resumed[0]["step"] == "6"


def test_a_world_that_shrank_reshards_from_memory_as_from_a_durable_checkpoint(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    """node-b is lost and the job goes on with one rank: it resumes from memory (node-b's
    shard from its buddy copy on node-a) at the step it had, and the state it trains on
    from there equals, bit for bit, a one-rank resume from a durable checkpoint of that
    step (DeepSpeed's universal conversion both ways)."""
    job = "shrunk"
    step = truth_and_lost_node(launch, make_spec, job)
    on = {"every_steps": 1000, "memory_every_steps": 1}
    alone = make_spec(train={**ZERO1, "steps": step + 2}, checkpoint={**on, "dir": "shrunk"})
    ranks = launch(alone, job_id=job, world_size=1, per_rank_env=node_env("node-a"))
    assert ranks.wait() == [0], ranks.log(0)
    resumed = ranks.events(0, "resumed_from")
    assert resumed and resumed[0]["tier"] == "memory" and resumed[0]["step"] == str(step)
    # the peer: the same step from a durable checkpoint, at the same world of one
    shutil.copytree(tmp_path / "ckpt" / f"step-{step}", tmp_path / "durable" / f"step-{step}")
    peer = make_spec(train={**ZERO1, "steps": step + 2}, checkpoint={**on, "dir": "durable"})
    ranks = launch(peer, job_id=f"{job}-durable", world_size=1, per_rank_env=node_env("node-a"))
    assert ranks.wait() == [0], ranks.log(0)
    resumed = ranks.events(0, "resumed_from")
    assert resumed and resumed[0]["tier"] == "durable" and resumed[0]["step"] == str(step)
    after = f"step-{step + 2}"
    assert_same_state(tmp_path / "shrunk" / after, tmp_path / "durable" / after)


def test_a_world_that_grew_resumes_from_memory_and_the_new_node_receives_the_state(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    """A one-rank job on node-a is killed with its snapshots in node-a's RAM and goes on as
    two ranks, node-c joining with nothing in RAM: both resume from memory at the step
    node-a had (node-c's rank from the universal copy rank 0 makes and sends it), and two
    steps later their state equals, bit for bit, a two-rank resume from a durable
    checkpoint of that step."""
    job = "grown"
    on = {"every_steps": 1000, "memory_every_steps": 1}
    truth = make_spec(train={**ZERO1, "steps": 40}, checkpoint={"every_steps": 1, "keep": 40})
    ranks = launch(truth, job_id=f"{job}-truth", world_size=1, per_rank_env=node_env("node-a"))
    assert ranks.wait() == [0], ranks.log(0)
    alone = make_spec(train={**ZERO1, "steps": 40}, checkpoint={**on, "dir": job})
    ranks = launch(alone, job_id=job, world_size=1, per_rank_env=node_env("node-a"))
    deadline = time.monotonic() + 120
    while (sealed_step(job, "node-a") or 0) < 5:
        assert time.monotonic() < deadline and ranks.procs[0].poll() is None, ranks.log(0)
        time.sleep(0.05)
    ranks.signal(signal.SIGKILL)
    ranks.wait(30)
    step = sealed_step(job, "node-a")
    assert step is not None and step >= 5
    assert not (SHM / memory_store_name(job) / "node-c").exists()  # nothing there to read
    grown = make_spec(train={**ZERO1, "steps": step + 2}, checkpoint={**on, "dir": job})
    ranks = launch(grown, job_id=job, per_rank_env=node_env("node-a", "node-c"))
    assert ranks.wait() == [0, 0], ranks.log(1)
    for rank in (0, 1):
        resumed = ranks.events(rank, "resumed_from")
        assert resumed and resumed[0]["tier"] == "memory" and resumed[0]["step"] == str(step)
    # the peer: the same step from a durable checkpoint, at the same world of two
    shutil.copytree(tmp_path / "ckpt" / f"step-{step}", tmp_path / "durable" / f"step-{step}")
    peer = make_spec(train={**ZERO1, "steps": step + 2}, checkpoint={**on, "dir": "durable"})
    ranks = launch(peer, job_id=f"{job}-durable", per_rank_env=node_env("node-a", "node-c"))
    assert ranks.wait() == [0, 0], ranks.log(0)
    resumed = ranks.events(0, "resumed_from")
    assert resumed and resumed[0]["tier"] == "durable" and resumed[0]["step"] == str(step)
    after = f"step-{step + 2}"
    assert_same_state(tmp_path / job / after, tmp_path / "durable" / after)
