"""The hang watch's I/O shell: every ``hang_check_s`` it reads each live rank's beat and
``/proc/<pid>/stat``, asks :func:`nodeagent.hangwatch.judge`, captures stacks when the
verdict needs them (:mod:`nodeagent.rankprobe`), and emits one ``worker.hung`` per culprit
per job attempt through the agent's event path.

Stacks are captured once per stall: a victim waiting in a collective is signalled once,
not at every pass. State is kept per (job, rank, pid) and dropped once the rank is gone.

Every pass reads ``now`` from the clock the watch is given: how long a rank has been seen
stopped and how long it has stalled are both measured on it. Ranks stamp their beats with
``CLOCK_MONOTONIC``, so in production that is the system's clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import msgspec
import structlog

from nodeagent.hangwatch import (
    UNKNOWN,
    Kind,
    Proc,
    Thresholds,
    Verdict,
    fallback,
    judge,
    main_first,
    threads_in,
)
from nodeagent.rankprobe import ProcStat, capture_stacks, proc_stat
from proto.events import EventBase, Severity, WorkerHung
from proto.job import JobSpec
from ringmaster import rankbeat
from ringmaster.clock import SYSTEM, Clock
from ringmaster.rankbeat import RankBeat
from ringmaster.rundir import JobDir

log = structlog.get_logger()
STACKS_CAP = 8192  # characters of stacks an event carries
STACK_TRIES = 3
_Key = tuple[str, int, int]  # (job, rank, pid)


class Process(Protocol):
    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...


class Run(Protocol):
    """What the watch needs of a supervised job (``nodeagent.supervisor.JobRun``)."""

    @property
    def attempt(self) -> int: ...

    @property
    def procs(self) -> Mapping[int, Process]: ...


class Supervised(Protocol):
    """What the watch needs of the supervisor (``nodeagent.supervisor.Supervisor``)."""

    @property
    def run_dir(self) -> Path: ...

    @property
    def runs(self) -> Mapping[str, Run]: ...


class HangWatch:
    """Watches the ranks of ``supervisor.runs``; ``emit`` is the agent's event path."""

    def __init__(
        self,
        supervisor: Supervised,
        emit: Callable[[EventBase], Awaitable[None]],
        node: str,
        *,
        interval_s: float = 0.5,
        clock: Clock = SYSTEM,
    ) -> None:
        self.supervisor = supervisor
        self.emit = emit
        self.node = node
        self.interval_s = interval_s
        self.clock = clock
        self._stopped_since: dict[_Key, float] = {}
        self._episodes: dict[_Key, tuple[tuple[int, float], Verdict, str]] = {}
        self._reported: set[tuple[str, int, int]] = set()  # (job, attempt, rank)
        self._thresholds: dict[tuple[str, int], Thresholds] = {}
        self._seen: set[_Key] = set()

    async def run(self) -> None:
        while True:
            started = self.clock.monotonic()
            try:
                await self.check()
            except Exception as exc:  # one bad pass must not end the watch
                log.warning("hang watch pass failed", error=repr(exc))
            took = self.clock.monotonic() - started
            await asyncio.sleep(max(0.0, self.interval_s - took))

    async def check(self) -> list[WorkerHung]:
        """One pass over every live rank of every supervised job; the events emitted."""
        self._seen = set()
        emitted: list[WorkerHung] = []
        runs = list(self.supervisor.runs.items())
        for job, run in runs:
            emitted += await self._check_job(job, run)
        # forget ranks that are gone and attempts that are over
        seen = self._seen
        self._stopped_since = {k: v for k, v in self._stopped_since.items() if k in seen}
        self._episodes = {k: v for k, v in self._episodes.items() if k in seen}
        current = {(job, run.attempt) for job, run in runs}
        self._thresholds = {k: v for k, v in self._thresholds.items() if k in current}
        return emitted

    async def _check_job(self, job: str, run: Run) -> list[WorkerHung]:
        jobdir = JobDir(self.supervisor.run_dir, job)
        thresholds = self._thresholds_of(job, run.attempt, jobdir)
        verdicts: dict[int, Verdict] = {}
        seen: dict[int, tuple[RankBeat | None, Proc, str]] = {}
        emitted: list[WorkerHung] = []
        for rank, process in sorted(run.procs.items()):
            if process.returncode is not None or (job, run.attempt, rank) in self._reported:
                continue
            beat, pid, stat = self._observe(jobdir, rank, process.pid)
            if stat is None or stat.state in ("Z", "X"):  # gone, not yet reaped
                continue
            key = (job, rank, pid)
            self._seen.add(key)
            now = self.clock.monotonic()
            if stat.stopped:
                self._stopped_since.setdefault(key, now)
            else:
                self._stopped_since.pop(key, None)
            proc = Proc(pid, stat.state, now - self._stopped_since.get(key, now))
            verdict, stacks = await self._judge(key, jobdir, beat, proc, now, thresholds)
            verdicts[rank], seen[rank] = verdict, (beat, proc, stacks)
            if verdict.kind == Kind.CULPRIT:
                emitted.append(await self._report(job, run.attempt, rank, seen[rank], verdict))
        lowest = fallback(verdicts)
        if lowest is not None and not any(
            (job, run.attempt, r) in self._reported for r in run.procs
        ):
            first = verdicts[lowest]
            unknown = Verdict(Kind.CULPRIT, first.stalled_s, first.threshold_s, UNKNOWN)
            emitted.append(await self._report(job, run.attempt, lowest, seen[lowest], unknown))
        return emitted

    def _observe(
        self, jobdir: JobDir, rank: int, pid: int
    ) -> tuple[RankBeat | None, int, ProcStat | None]:
        """The rank's beat (None when absent or another process's) and the process it
        names: the rank itself, or a process in its group (a wrapper's child)."""
        beat = rankbeat.read(jobdir.rank_beat(rank))
        if beat is not None and beat.pid != pid:
            child = proc_stat(beat.pid)
            if child is not None and child.pgrp == pid:
                return beat, beat.pid, child
            beat = None
        return beat, pid, proc_stat(pid)

    async def _judge(
        self,
        key: _Key,
        jobdir: JobDir,
        beat: RankBeat | None,
        proc: Proc,
        now: float,
        thresholds: Thresholds,
    ) -> tuple[Verdict, str]:
        """The verdict and, for a culprit or a stalled rank, its stacks: captured once per
        stall, so that a victim is not signalled again and again while it waits."""
        log_path, fifo = jobdir.rank_log(key[1]), jobdir.rank_stacks(key[1])
        verdict = judge(beat, proc, now, thresholds)
        if verdict.kind == Kind.CULPRIT:
            return verdict, await self._stacks(proc, log_path, fifo, beat)
        if verdict.kind != Kind.STALLED or beat is None:
            self._episodes.pop(key, None)
            return verdict, ""
        episode = (beat.step, max(beat.step_at or 0.0, beat.phase_since))
        cached = self._episodes.get(key)
        if cached is not None and cached[0] == episode:
            _, first, stacks = cached
            return replace(first, stalled_s=verdict.stalled_s), stacks
        dump = await capture_stacks(proc.pid, log_path, fifo, stopped=False)
        verdict = judge(beat, proc, now, thresholds, dump)
        stacks = main_first(dump, beat.main_thread, STACKS_CAP)
        self._episodes[key] = (episode, verdict, stacks)
        if verdict.kind == Kind.VICTIM:
            log.info(
                "stalled rank is a victim",
                job=key[0],
                rank=key[1],
                stalled_s=round(verdict.stalled_s, 1),
                why=verdict.evidence,
            )
        return verdict, stacks

    async def _stacks(self, proc: Proc, log_path: Path, fifo: Path, beat: RankBeat | None) -> str:
        """The culprit's stacks, the main thread's first. A stopped rank is continued for
        its dump, and its other threads run meanwhile; a faulthandler dump (the fallback,
        taken without the GIL) has been seen to end at a thread that unwound as it walked
        its frames, without the main thread. Such a dump is asked for again (the thread is
        back in its wait by then), up to ``STACK_TRIES`` times."""
        main = beat.main_thread if beat is not None else 0
        dump = ""
        for _ in range(STACK_TRIES):
            dump = await capture_stacks(proc.pid, log_path, fifo, stopped=proc.stopped)
            if not dump or not main or main in threads_in(dump):
                break
            log.info("stacks without the main thread; asking again", pid=proc.pid)
        return main_first(dump, main, STACKS_CAP)

    async def _report(
        self,
        job: str,
        attempt: int,
        rank: int,
        seen: tuple[RankBeat | None, Proc, str],
        verdict: Verdict,
    ) -> WorkerHung:
        beat, proc, stacks = seen
        self._reported.add((job, attempt, rank))
        step = beat.step if beat is not None else 0
        event = WorkerHung(
            severity=Severity.CRITICAL,
            node=self.node,
            job=job,
            rank=rank,
            attempt=attempt,
            pid=proc.pid,
            step=step,
            stalled_s=round(verdict.stalled_s, 2),
            threshold_s=round(verdict.threshold_s, 2),
            evidence=verdict.evidence,
            stacks=stacks,
            culprit_unknown=verdict.evidence == UNKNOWN,
            message=(
                f"rank {rank} on {self.node} hung after step {step}: no progress for "
                f"{verdict.stalled_s:.1f} s (threshold {verdict.threshold_s:.1f} s); "
                f"{verdict.evidence}"
            ),
        )
        log.warning("rank hung", job=job, rank=rank, attempt=attempt, why=verdict.evidence)
        await self.emit(event)
        return event

    def _thresholds_of(self, job: str, attempt: int, jobdir: JobDir) -> Thresholds:
        """The job's policy thresholds, read once per attempt; the defaults (and one
        warning) when its spec cannot be read."""
        found = self._thresholds.get((job, attempt))
        if found is None:
            try:
                spec = msgspec.json.decode(jobdir.spec.read_bytes(), type=JobSpec)
                found = Thresholds.of(spec.policy)
            except (OSError, msgspec.DecodeError) as exc:
                log.warning("hang watch uses default thresholds", job=job, error=str(exc))
                found = Thresholds()
            self._thresholds[(job, attempt)] = found
        return found
