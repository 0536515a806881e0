"""What a heartbeat says about the node's ranks (``proto.node.RankReport``): every rank of
the latest attempt of each job the supervisor knows, alive or exited, so a coordinator that
missed a ``worker.exited`` learns of the exit one beat later.

An exited rank stays reported, with its status, until the next launch of its job on this
node replaces the attempt, or until :data:`~proto.node.RANK_MEMORY_S` after the last rank
of the attempt exited: a finished job is not reported for ever.

Beside the reports, the attempts whose launch is complete (:func:`launched`): a beat built
before the agent had started an attempt's ranks cannot say they are missing, and the
coordinator reads only a beat that names the attempt as proof of absence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from proto.node import RANK_MEMORY_S, RankReport
from ringmaster import rankbeat
from ringmaster.rundir import JobDir


@dataclass(frozen=True)
class RankExit:
    """How a rank ended: a status, or the signal that ended it; neither when unknown (it
    was not this agent's child and left no exit record)."""

    code: int | None
    signal: int | None
    at: float  # time.monotonic() when the agent saw the exit


class _Process(Protocol):
    @property
    def pid(self) -> int: ...


class Run(Protocol):
    """What the reports need of a supervised job (``nodeagent.supervisor.JobRun``)."""

    @property
    def attempt(self) -> int: ...

    @property
    def procs(self) -> Mapping[int, _Process]: ...

    @property
    def exits(self) -> Mapping[int, RankExit]: ...

    @property
    def launched(self) -> bool: ...


def rank_reports(runs: Mapping[str, Run], run_dir: Path, now: float) -> list[RankReport]:
    """The reports for ``runs`` at ``now`` (``time.monotonic()``), by job and rank; each
    rank's ``last_step`` is its beat's (``JobDir.rank_beat``)."""
    reports = []
    for job, run in sorted(runs.items()):
        if _forgotten(run, now):
            continue
        jobdir = JobDir(run_dir, job)
        for rank, proc in sorted(run.procs.items()):
            beat = rankbeat.read(jobdir.rank_beat(rank))
            ended = run.exits.get(rank)
            reports.append(
                RankReport(
                    job=job,
                    rank=rank,
                    attempt=run.attempt,
                    pid=proc.pid,
                    alive=ended is None,
                    exit_code=ended.code if ended else None,
                    signal=ended.signal if ended else None,
                    last_step=beat.step if beat is not None else 0,
                )
            )
    return reports


def launched(runs: Mapping[str, Run], now: float) -> dict[str, int]:
    """Per job reported at ``now``, its attempt once the launch has started every rank of
    it here (the ranks are then all in the reports); a job whose launch is still under way,
    or failed, is not named."""
    return {
        job: run.attempt
        for job, run in sorted(runs.items())
        if run.launched and not _forgotten(run, now)
    }


def _forgotten(run: Run, now: float) -> bool:
    """Every rank of the run exited, the last more than RANK_MEMORY_S ago."""
    if not run.procs or set(run.procs) - set(run.exits):
        return False
    return now - max(e.at for e in run.exits.values()) > RANK_MEMORY_S
