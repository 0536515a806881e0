"""The jobs this leader holds: each one's record and books, its tasks in flight, and the
record's saving.

A record is what the store keeps (compare-and-set, :mod:`coordinator.jobstore`); its books
(:mod:`coordinator.job_books`) are what the leader notes beside it in memory. One object
holds both, and the manager hands it to the parts that act on jobs, so none keeps a map of
its own that could fall out of step with the records.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

from coordinator.cas import CasStore, Conflict
from coordinator.job_books import Books
from coordinator.jobstore import JobStore
from coordinator.loss_verdict import AwaitedVerdicts
from proto.job import JobRecord
from ringmaster.clock import Clock

log = structlog.get_logger()


class JobTable:
    def __init__(self, store: CasStore, clock: Clock) -> None:
        self.store, self.clock = JobStore(store), clock
        self.jobs: dict[str, JobRecord] = {}
        self.awaited = AwaitedVerdicts()  # lost nodes' verdicts, waiting for their peers
        self._books: dict[str, Books] = {}

    async def load(self) -> None:
        """Every record the store holds replaces this leader's copy, in the one map the
        table has for its life (the manager hands it out); the books stay (a leader that
        leads again knows what it noted before)."""
        loaded = await self.store.load()
        self.jobs.clear()
        self.jobs.update(loaded)

    def books(self, job_id: str) -> Books:
        """``job_id``'s books, begun empty the first time they are asked for."""
        books = self._books.get(job_id)
        if books is None:
            books = self._books[job_id] = Books()
        return books

    def changed(self, job: JobRecord) -> None:
        """``job``'s record changed: saved at the next flush, if not before."""
        self.books(job.id).dirty = True

    async def save(self, job: JobRecord) -> None:
        """Compare-and-set; on a conflict the record another leader wrote replaces ours
        and the conflict propagates, so nothing acts on the stale transition."""
        job.updated_at = self.clock.time()
        try:
            await self.store.save(job)
        except Conflict:
            current = await self.store.read(job.id)
            if current is not None:
                self.jobs[job.id] = current
            raise
        self.books(job.id).dirty = False

    async def flush(self) -> None:
        for job_id in [j for j, books in self._books.items() if books.dirty]:
            await self.save(self.jobs[job_id])

    # -- tasks ------------------------------------------------------------------------

    def spawn(self, job: str, what: str, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task (one per job and kind), logging its failure."""

        async def logged() -> None:
            try:
                await work
            except Conflict:
                log.warning("another leader holds the job now", job=job, task=what)
            except Exception as exc:
                log.error("job task failed", job=job, task=what, error=repr(exc))

        self.books(job).tasks[what] = asyncio.create_task(logged(), name=f"{what}:{job}")

    def busy(self, job: str, what: str) -> bool:
        task = self.books(job).tasks.get(what)
        return task is not None and not task.done()

    def abandon(self) -> None:
        """Leadership lost: what this leader had under way is its successor's now."""
        for books in self._books.values():
            for task in books.tasks.values():
                task.cancel()
            books.tasks.clear()

    async def settle(self) -> None:
        """Wait for every task in flight (tests, and a leader stepping down)."""
        while pending := [
            t for books in self._books.values() for t in books.tasks.values() if not t.done()
        ]:
            await asyncio.gather(*pending, return_exceptions=True)
