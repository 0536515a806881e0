"""Ranks an earlier agent process started, taken over by this one.

Ranks outlive their agent by design (each runs in its own session), so an agent restarted
under a running job (systemd's ``Restart=on-failure`` after a crash, a ``kill -9``) finds
them in its run directory (``ringmaster.rundir``): every job with a live rank there is
adopted, with the attempt recorded at launch and every rank that has a PID file — live
ones watched until they exit, ones that died while no agent was there reported at once.
A job none of whose ranks is alive any more is not: its ranks' exits are the
coordinator's to notice (the job's ranks are missing from this node's heartbeat).

An adopted rank is not this agent's child, so it cannot be ``wait()``-ed: its exit is seen
through a pidfd (readable once the process has exited), or by polling where pidfds are
not available, and its status is read from the exit record the rank left beside its PID
file (``ringmaster.rundir.read_exit``). A rank that died without one (a SIGKILL) has no
known status: ``wait`` returns None. The record is read once the process is reaped, not
merely exited: a rank forked from a template interpreter (``nodeagent.warm_pool``) is the
template's child, and the template writes the status it reaps (a signal too) just before
it reaps it. The same class watches such a rank from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import NamedTuple, Protocol

from ringmaster.procs import start_time, wait_until_async
from ringmaster.rundir import JobDir, is_rank, live_ranks, read_exit

POLL_S = 0.2  # how often a rank is looked at without a pidfd
# How long an exited rank may stay a zombie before its record is read all the same: its
# parent reaps it at once (a template, or init once the agent that started it is gone)
# unless that parent is wedged.
REAP_S = 5.0


class Found(NamedTuple):
    """A job with ranks to adopt: its attempt, and rank → (PID, start time)."""

    job: str
    attempt: int
    ranks: dict[int, tuple[int, int | None]]


def adoptable(run_dir: Path) -> list[Found]:
    """Every job under ``run_dir`` with at least one live rank, with all its ranks."""
    jobs = sorted({rank.job for rank in live_ranks(run_dir)})
    found = []
    for job in jobs:
        jobdir = JobDir(run_dir, job)
        found.append(Found(job, jobdir.read_attempt(), jobdir.recorded_ranks()))
    return found


class RankProcess(Protocol):
    """A rank's process: a child (``asyncio.subprocess.Process``) or an adopted rank
    (:class:`AdoptedRank`, whose ``wait`` may not know the status)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int | None: ...


class AdoptedRank:
    """A rank's process seen as a child's is (``pid``, ``returncode``, ``wait``), for one
    this agent did not start. ``returncode`` stays None after an exit whose status is
    unknown; ``ran`` tells whether it was still running when adopted (only then may what
    is left of its process group be killed: the group id of a long-gone rank may have been
    reused)."""

    def __init__(self, job: str, pid: int, started: int | None, record: Path) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.ran = False
        self._job = job
        self._started = started
        self._record = record

    async def wait(self) -> int | None:
        """Once the rank has exited: its exit status, None when unknown. One caller."""
        try:
            fd: int | None = os.pidfd_open(self.pid)
        except OSError:  # gone already (the check below says so), or no pidfds here
            fd = None
        try:
            # after the pidfd is open, so a PID reused in between is not taken for the rank
            self.ran = self._running()
            if self.ran and fd is not None:
                await _readable(fd)
            elif self.ran:
                await wait_until_async(self._gone, None, POLL_S)
        finally:
            if fd is not None:
                os.close(fd)
        with contextlib.suppress(TimeoutError):  # (at once for a process long gone)
            await wait_until_async(self._reaped, REAP_S, POLL_S / 10)
        record = read_exit(self._record)
        if record is not None and record.pid == self.pid:
            self.returncode = record.code
        return self.returncode

    def _running(self) -> bool:
        return is_rank(self.pid, self._job, self._started)

    async def _gone(self) -> bool:
        return not self._running()

    async def _reaped(self) -> bool:
        """No zombie of it is left (its PID is gone, or another process's now)."""
        return self._started is None or start_time(self.pid) != self._started


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def exited() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, exited)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
