"""A job's first launch has no earlier attempt to resume from: whatever the node's memory
store holds under its id (another run of a job with the same id: a resubmission, a
test) is cleared, and a later attempt keeps what its predecessors left."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest

from ringmaster.checkpoints import step_dir_name
from ringmaster.memory_store import SHM, memory_store_name, node_store
from ringmaster.rank import memory_tier
from ringmaster.rank.coordination import Coordination


@pytest.fixture
def job_id() -> Iterator[str]:
    job = f"first-attempt-{uuid.uuid4().hex[:8]}"
    yield job
    shutil.rmtree(SHM / memory_store_name(job), ignore_errors=True)


@pytest.mark.skipif(node_store("x", "n") is None, reason="this host has no writable /dev/shm")
@pytest.mark.parametrize("first", [True, False])
def test_only_the_first_attempt_clears_the_nodes_store(job_id: str, first: bool) -> None:
    root = node_store(job_id, "node-a")
    assert root is not None
    leftover = root / step_dir_name(26)
    leftover.mkdir(parents=True)
    tier, said = memory_tier.build(Coordination(), job_id, "node-a", None, 100, False, first)
    assert tier is not None and said.startswith("on:")
    assert leftover.exists() is not first
