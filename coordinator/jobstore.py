"""Job records behind the compare-and-set seam (:mod:`coordinator.cas`), like the lease.

Every write names the revision this leader last read or wrote; a deposed leader's late
write loses (:class:`~coordinator.cas.Conflict`) instead of overwriting its successor's
state, and the loser's in-memory copy is replaced by what the store holds.
"""

from __future__ import annotations

import asyncio

import msgspec
import structlog

from coordinator.cas import CasStore, Conflict
from proto.codec import encode, job_decoder
from proto.job import JobRecord

log = structlog.get_logger()


class JobStore:
    def __init__(self, cas: CasStore) -> None:
        self.cas = cas
        self._revs: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def load(self) -> dict[str, JobRecord]:
        """Every job record (a new leader continues where the last one was); a record that
        does not decode is skipped with a warning, never fatal."""
        self._revs.clear()
        jobs: dict[str, JobRecord] = {}
        for key in await self.cas.keys():
            job = await self.read(key)
            if job is not None:
                jobs[key] = job
        return jobs

    async def read(self, job_id: str) -> JobRecord | None:
        found = await self.cas.get(job_id)
        if found is None:
            return None
        data, rev = found
        try:
            job: JobRecord = job_decoder.decode(data)
        except msgspec.DecodeError as exc:
            log.warning("unreadable job record skipped", job=job_id, error=str(exc))
            return None
        self._revs[job_id] = rev
        return job

    async def save(self, job: JobRecord) -> None:
        """Compare-and-set on the record's revision; raises Conflict when another leader
        wrote since. Saves of one job are serialised: the ticker, a launch and progress may
        all save the same job at once."""
        async with self._locks.setdefault(job.id, asyncio.Lock()):
            data = encode(job)
            last = self._revs.get(job.id)
            try:
                if last is None:
                    self._revs[job.id] = await self.cas.create(job.id, data)
                else:
                    self._revs[job.id] = await self.cas.update(job.id, data, last)
            except Conflict:
                log.error("job record changed under us: another leader wrote it", job=job.id)
                raise
