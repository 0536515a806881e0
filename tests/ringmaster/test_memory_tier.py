"""The memory tier on real ranks: snapshots in RAM on the rank's node and its buddy's,
restored after a node's loss to the bit."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from proto.job import memory_store_name
from ringmaster.memory_store import MemoryStore
from ringmaster.procs import wait_until
from tests.trainer.test_trainer_deepspeed import MakeSpec, checkpoint_tensors

pytestmark = pytest.mark.slow

SHM = Path("/dev/shm")
ZERO1 = {"engine": "deepspeed", "zero_stage": 1, "precision": "fp32"}
MEMORY_ONLY = {"every_steps": 1000, "memory_every_steps": 1}  # a snapshot every step


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


def truth(launch: Any, make_spec: MakeSpec, job: str, *nodes: str) -> None:
    """The truth: ``job`` uninterrupted on ``nodes``, a durable checkpoint of every step
    in ``ckpt``."""
    spec = make_spec(train={**ZERO1, "steps": 40}, checkpoint={"every_steps": 1, "keep": 40})
    ranks = launch(
        spec, job_id=f"{job}-truth", world_size=len(nodes), per_rank_env=node_env(*nodes)
    )
    assert ranks.wait() == [0] * len(nodes), ranks.log(0)


def killed_once_sealed(launch: Any, make_spec: MakeSpec, job: str, *nodes: str) -> int:
    """``job`` on ``nodes`` with memory snapshots only, every rank killed once the first
    node holds step 5 or later: that step."""
    spec = make_spec(train={**ZERO1, "steps": 40}, checkpoint={**MEMORY_ONLY, "dir": job})
    ranks = launch(spec, job_id=job, world_size=len(nodes), per_rank_env=node_env(*nodes))

    def sealed() -> int | None:
        assert ranks.procs[0].poll() is None, ranks.log(0)
        step = sealed_step(job, nodes[0])
        return step if step is not None and step >= 5 else None

    wait_until(sealed, 120)
    ranks.signal(signal.SIGKILL)
    ranks.wait(30)
    step = sealed_step(job, nodes[0])  # the newest, sealed before the kill
    assert step is not None and step >= 5
    return step


def truth_and_lost_node(launch: Any, make_spec: MakeSpec, job: str) -> int:
    """The truth on node-a and node-b, then ``job`` there, killed with node-b's RAM once
    node-a holds step 5 or later: that step."""
    truth(launch, make_spec, job, "node-a", "node-b")
    # node-b is lost, and rank 0 with it (its world is gone)
    step = killed_once_sealed(launch, make_spec, job, "node-a", "node-b")
    shutil.rmtree(SHM / memory_store_name(job) / "node-b")  # node-b's RAM went with it
    return step


def assert_resumed(ranks: Any, tier: str, step: int, world: int) -> None:
    for rank in range(world):
        resumed = ranks.events(rank, "resumed_from")
        assert resumed and resumed[0]["tier"] == tier and resumed[0]["step"] == str(step)
        # the restore's parts, in seconds, each within the whole
        took = float(resumed[0]["took_s"])
        parts = ("offers_s", "transfer_s", "verify_s") if tier == "memory" else ()
        assert all(0 <= float(resumed[0][part]) <= took for part in parts), resumed[0]


def resume_on(launch: Any, make_spec: MakeSpec, job: str, steps: int, *nodes: str) -> Any:
    """``job`` launched again on ``nodes`` to ``steps``, run to its end: its ranks."""
    spec = make_spec(train={**ZERO1, "steps": steps}, checkpoint={**MEMORY_ONLY, "dir": job})
    ranks = launch(spec, job_id=job, world_size=len(nodes), per_rank_env=node_env(*nodes))
    assert ranks.wait() == [0] * len(nodes), ranks.log(len(nodes) - 1)
    return ranks


def assert_as_from_a_durable_checkpoint(
    tmp_path: Path, launch: Any, make_spec: MakeSpec, job: str, step: int, *nodes: str
) -> None:
    """``job``'s state two steps after it resumed at ``step`` equals, bit for bit, that of
    the same world resumed from the truth's durable checkpoint of ``step``."""
    peer = f"{job}-durable"
    shutil.copytree(tmp_path / "ckpt" / f"step-{step}", tmp_path / peer / f"step-{step}")
    ranks = resume_on(launch, make_spec, peer, step + 2, *nodes)
    assert_resumed(ranks, "durable", step, 1)
    after = f"step-{step + 2}"
    assert_same_state(tmp_path / job / after, tmp_path / peer / after)


def test_a_lost_node_is_restored_from_its_buddy_to_the_bit(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    job = "faulted"
    step = truth_and_lost_node(launch, make_spec, job)
    # rank 1 comes back on a new node: its shard only exists as rank 0's buddy copy
    ranks = resume_on(launch, make_spec, job, step, "node-a", "node-c")
    assert_resumed(ranks, "memory", step, 2)
    assert_same_state(tmp_path / job / f"step-{step}", tmp_path / "ckpt" / f"step-{step}")
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
    ranks = resume_on(launch, make_spec, job, step + 2, "node-a")
    assert_resumed(ranks, "memory", step, 1)
    assert_as_from_a_durable_checkpoint(tmp_path, launch, make_spec, job, step, "node-a")


def test_a_world_that_grew_resumes_from_memory_and_the_new_node_receives_the_state(
    tmp_path: Path, launch: Any, make_spec: MakeSpec
) -> None:
    """A one-rank job on node-a is killed with its snapshots in node-a's RAM and goes on as
    two ranks, node-c joining with nothing in RAM: both resume from memory at the step
    node-a had (node-c's rank from the universal copy rank 0 makes and sends it), and two
    steps later their state equals, bit for bit, a two-rank resume from a durable
    checkpoint of that step."""
    job = "grown"
    truth(launch, make_spec, job, "node-a")
    step = killed_once_sealed(launch, make_spec, job, "node-a")
    assert not (SHM / memory_store_name(job) / "node-c").exists()  # nothing there to read
    ranks = resume_on(launch, make_spec, job, step + 2, "node-a", "node-c")
    assert_resumed(ranks, "memory", step, 2)
    nodes = ("node-a", "node-c")
    assert_as_from_a_durable_checkpoint(tmp_path, launch, make_spec, job, step, *nodes)
