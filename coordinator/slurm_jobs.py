"""Jobs whose Slurm allocation is gone are stopped.

``start --wait`` in the batch step stops its job when Slurm warns that the allocation
ends; but a batch step killed outright (``scancel --signal=KILL``, a node failure of the
batch host, a ``KillWait`` too short) says nothing, and the ranks, children of the agents
rather than of Slurm, would train on on nodes Slurm has given to someone else. So the
leader asks Slurm, every pass, about each live job started inside an allocation; once that
allocation no longer holds its nodes, the job is stopped (at a step, with a checkpoint,
as any stop) and its record says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import structlog

from proto.api import JobControl
from proto.job import JobRecord
from ringmaster import slurm
from ringmaster.slurm import HOLDING, SlurmError

log = structlog.get_logger()


def gone(jobs: Iterable[JobRecord], states: dict[str, str]) -> list[tuple[str, str]]:
    """(job id, why) for each live job whose allocation's Slurm state no longer holds its
    nodes; ``states``: Slurm job id → state, for the allocations asked about."""
    out = []
    for job in jobs:
        alloc = job.allocation
        if job.state.terminal or alloc is None or alloc.job_id not in states:
            continue
        state = states[alloc.job_id]
        if state not in HOLDING:
            out.append((job.id, f"Slurm job {alloc.job_id} is {state}: its allocation is gone"))
    return out


class SlurmAllocations:
    def __init__(
        self,
        jobs: Callable[[], Iterable[JobRecord]],
        stop: Callable[[JobControl], Awaitable[object]],
    ) -> None:
        self.jobs, self.stop = jobs, stop

    async def reconcile(self) -> None:
        live = [j for j in self.jobs() if not j.state.terminal and j.allocation is not None]
        states: dict[str, str] = {}
        for alloc_id in {j.allocation.job_id for j in live if j.allocation is not None}:
            try:
                states[alloc_id] = await asyncio.to_thread(slurm.job_state, alloc_id)
            except SlurmError as exc:  # unknown is not gone: ask again next pass
                log.warning(
                    "Slurm job state unknown; will retry", slurm_job=alloc_id, error=str(exc)
                )
        for job_id, why in gone(live, states):
            log.warning("stopping a job whose allocation is gone", job=job_id, why=why)
            await self.stop(JobControl(job=job_id, action="stop", reason=why))
