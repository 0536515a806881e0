"""A job inside a Slurm allocation that holds a node Ringmaster will not use: it says so
at once (``job.pending`` naming the node and why) and, past its bound, stops to be
requeued instead of holding the allocation idle."""

from __future__ import annotations

import pytest
from test_jobs import Cluster, spec

from coordinator import placement_policy
from proto.api import SubmitJob
from proto.events import JobPending
from proto.job import Allocation, JobState

pytestmark = pytest.mark.anyio


async def test_a_node_of_the_allocation_ringmaster_will_not_use_is_said_then_requeued() -> None:
    c = Cluster()
    m = c.leader()
    c.registry.nodes["node-1"].drain_reason = "probation after nvme.readonly: …"  # its life's
    c.registry.nodes["node-1"].settle()
    inside = Allocation(job_id="42", hosts=["node-0", "node-1"])
    reply = await m.submit(SubmitJob(spec=spec(2), workdir="/w", allocation=inside))
    job = m.jobs[reply.job]
    await m.tick()
    await m.settle()
    [pending] = [e for e in c.events if isinstance(e, JobPending)]
    assert pending.waiting_for == {"node-1": "node is draining (probation after nvme.readonly: …)"}
    assert pending.bound_s == placement_policy.ALLOCATION_START_WAIT_S
    assert "stops to be requeued in 60 s" in pending.message
    c.advance(placement_policy.ALLOCATION_START_WAIT_S - 1)
    await m.tick()
    await m.settle()
    assert job.state is JobState.PENDING
    assert len([e for e in c.events if isinstance(e, JobPending)]) == 1  # said once
    c.advance(1)
    await m.tick()
    await m.settle()
    stored = await c.stored(job.id)
    assert stored.state is JobState.STOPPED and stored.requeue
    assert stored.reason.startswith("cannot start inside Slurm job 42's allocation")
