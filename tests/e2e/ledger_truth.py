"""Where a job's seconds went, as its ranks saw them: the truth the coordinator's goodput
ledger is checked against. Read from rank 0's log lines of every attempt (each carries
``wall=``, the Unix time): its steps (``step_s``), checkpoint stalls and pauses.

Per attempt, training runs from the start of its first step (its end less the attempt's
median step time: a first step's extra cost is the start's) to the end of its last step,
less the checkpoint stalls and pauses inside that span. Before the first attempt's first
step is start-up; between one attempt's last step and the next attempt's first is
recovery; steps an attempt trained past the checkpoint the next one resumed from are lost
work (their count × the median of their own gaps from the step before), taken out of
training. A gap
between two steps longer than the hang threshold (max(3 × the attempt's median step,
3 s), the policy's defaults) trains for the threshold only: the rest is recovery.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ringmaster.rank.log import read


@dataclass
class Attempt:
    resumed_from: int
    steps: list[tuple[float, int, float]] = field(default_factory=list)  # wall, step, step_s
    stalls: list[tuple[float, float]] = field(default_factory=list)  # wall, stall_s
    pauses: list[tuple[float, float]] = field(default_factory=list)  # paused → resumed walls


def attempts(home: Path, job: str) -> list[Attempt]:
    """Every attempt's rank 0 lines, from every node's ``rank-0.log`` of the job."""
    lines: list[tuple[float, str, dict[str, str]]] = []
    for log in home.glob(f"nodes/*/agent/jobs/{job}/rank-0.log"):
        for r in read(log.read_text(errors="replace")):
            if r["rank"] == "0":
                lines.append((float(r["wall"]), r["event"], r))
    out: list[Attempt] = []
    paused_at: float | None = None
    for wall, event, fields in sorted(lines, key=lambda line: line[0]):
        if event == "start":
            out.append(Attempt(int(fields["step"])))
        elif not out:
            continue
        elif event == "step":
            out[-1].steps.append((wall, int(fields["step"]), float(fields["step_s"])))
        elif event == "checkpoint_staged":
            out[-1].stalls.append((wall, float(fields["stall_s"])))
        elif event == "paused":
            paused_at = wall
        elif event == "resumed" and paused_at is not None:
            out[-1].pauses.append((paused_at, wall))
            paused_at = None
    return out


def stalled_gaps(run: Attempt, threshold: float) -> float:
    """Seconds of step-to-step gaps past ``threshold``, gaps holding a pause left out."""
    total = 0.0
    for (a, _, _), (b, _, _) in zip(run.steps, run.steps[1:], strict=False):
        if not any(a <= p <= b for p, _ in run.pauses):
            total += max(0.0, b - a - threshold)
    return total


def redone_gaps(run: Attempt, past: int) -> list[float]:
    """The gaps of ``run``'s steps after step ``past`` from the step before (the first
    step's: the attempt's median), each less the pauses and checkpoint stalls inside it."""
    median = statistics.median(s for _, _, s in run.steps)
    gaps, before = [], run.steps[0][0] - median
    for wall, step, _ in run.steps:
        if step > past:
            paused = sum(b - a for a, b in run.pauses if before <= a and b <= wall)
            stalled = sum(s for at, s in run.stalls if before < at <= wall)
            gaps.append(max(0.0, wall - before - paused - stalled))
        before = wall
    return gaps


def redone_seconds(run: Attempt, past: int) -> float:
    """Training seconds ``run`` spent on its steps after step ``past``: their count × the
    median of their own gaps (:func:`redone_gaps`). Their own gaps, since the steps just
    before a fault ran under that moment's load, not the attempt's average; their median,
    since a gap that held something else (an evaluation, a save of the loop's own) is not
    a step's time."""
    gaps = redone_gaps(run, past)
    return len(gaps) * statistics.median(gaps) if gaps else 0.0


def truth(runs: list[Attempt], started_at: float) -> dict[str, float]:
    """Seconds per ledger bucket (multiply by the world size for GPU-seconds)."""
    buckets = dict.fromkeys(
        ("startup", "productive", "paused", "checkpoint_stall", "recovery", "lost_work"), 0.0
    )
    previous: Attempt | None = None
    previous_end = started_at
    for run in runs:
        if not run.steps:
            continue  # stopped before its first step: all of it is the gap to the next
        median = statistics.median(s for _, _, s in run.steps)
        begin, end = run.steps[0][0] - median, run.steps[-1][0]
        buckets["startup" if previous is None else "recovery"] += begin - previous_end
        if previous is not None:
            redone = redone_seconds(previous, run.resumed_from)
            buckets["lost_work"] += redone
            buckets["productive"] -= redone
        inside = sum(s for wall, s in run.stalls if begin < wall <= end)
        paused = sum(b - a for a, b in run.pauses if begin < a and b <= end)
        stalled = stalled_gaps(run, max(3.0 * median, 3.0))
        buckets["productive"] += end - begin - inside - paused - stalled
        buckets["recovery"] += stalled
        buckets["paused"] += paused
        # a stall after the last step (the checkpoint a graceful stop makes) is stall too,
        # taken out of the gap that follows
        after = sum(s for wall, s in run.stalls if wall > end)
        buckets["checkpoint_stall"] += inside + after
        buckets["recovery"] -= after
        previous, previous_end = run, end
    return buckets


@dataclass(frozen=True)
class Tolerance:
    """How far the coordinator's ledger may be from the ranks' own account, derived from
    what this run measured rather than from constants tuned on a quiet machine.

    The ledger moves a bucket's boundary when the coordinator receives the message that
    marks it (a rank's stamp, clamped, or its own detection of a fault); the ranks' account
    places it at the step it logged. Each boundary may therefore be off by the delivery
    lag of that message plus a step on either side (which step a first step's warm-up or
    a fault's last step is counted against): ``per_boundary`` = ``lag_s`` + 2 × the p90
    of the ranks' step times. A job has two boundaries (start, end) plus two per restart
    and per pause. Lost work is redone steps × a time per step, the coordinator's from
    its step reports, the ranks' from the redone steps' own gaps: off by at most the
    spread of step times (p90 − p10) per redone step, plus one step's ambiguity per
    restart, plus whatever a redone step's own gap ran past the p90 (``redone_excess_s``).
    The ranks' account cannot tell such a gap's slow step from a rank stopped inside it (a
    hang that let the step finish after it was found): the coordinator counts that time
    as recovery or training, the ranks' median as lost work. Those seconds are still
    judged as training, productive and lost work together, within ``bucket_s``."""

    step_p10_s: float
    step_p90_s: float
    lag_s: float
    boundaries: int
    redone_steps: int
    restarts: int
    redone_excess_s: float = 0.0

    @property
    def per_boundary_s(self) -> float:
        return self.lag_s + 2 * self.step_p90_s

    @property
    def bucket_s(self) -> float:
        return self.boundaries * self.per_boundary_s

    @property
    def lost_work_s(self) -> float:
        spread = self.step_p90_s - self.step_p10_s
        return (
            self.redone_steps * spread
            + self.restarts * self.step_p90_s
            + self.lag_s
            + self.redone_excess_s
        )

    def __str__(self) -> str:
        return (
            f"steps p10 {self.step_p10_s:.3f} s, p90 {self.step_p90_s:.3f} s; delivery lag "
            f"{self.lag_s:.2f} s; {self.boundaries} boundaries × {self.per_boundary_s:.2f} s "
            f"= {self.bucket_s:.2f} s a bucket; lost work ± {self.lost_work_s:.2f} s "
            f"({self.redone_steps} steps redone, {self.redone_excess_s:.2f} s of them past the p90)"
        )


def tolerance(final: Mapping[str, Any], runs: list[Attempt], events: list[Any]) -> Tolerance:
    """The bounds this job's own run sets (:class:`Tolerance`). The delivery lag is the
    longest seen between a rank 0 log line and the coordinator's record of it: the first
    step (``first_step_at``, when the coordinator took it), and every pause and resume
    (their ``job.paused``/``job.resumed`` events against rank 0's ``paused``/``resumed``
    lines)."""
    gaps = sorted(s for run in runs for _, _, s in run.steps)
    p10, p90 = (
        (gaps[len(gaps) // 10], gaps[min(len(gaps) - 1, (9 * len(gaps)) // 10)])
        if gaps
        else (0.0, 0.0)
    )
    lags = []
    first = next((run.steps[0][0] for run in runs if run.steps), None)
    if first is not None and final.get("first_step_at"):
        lags.append(final["first_step_at"] - first)
    said = {
        kind: sorted(_seconds(e["time"]) for e in events if e["kind"] == kind)
        for kind in ("job.paused", "job.resumed")
    }
    logged = {"job.paused": [a for run in runs for a, _ in run.pauses]}
    logged["job.resumed"] = [b for run in runs for _, b in run.pauses]
    for kind, walls in logged.items():
        lags += [t - w for w, t in zip(sorted(walls), said[kind], strict=False)]
    redone, excess, before = 0, 0.0, None
    for run in (run for run in runs if run.steps):  # as truth() pairs them
        if before is not None:
            gaps = redone_gaps(before, run.resumed_from)
            redone += len(gaps)
            excess += sum(max(0.0, gap - p90) for gap in gaps)
        before = run
    restarts = final["restarts"]
    return Tolerance(
        step_p10_s=p10,
        step_p90_s=p90,
        lag_s=max([0.0, *lags]),
        boundaries=2 + 2 * restarts + 2 * final["pauses"],
        redone_steps=redone,
        restarts=restarts,
        redone_excess_s=excess,
    )


def check_ledger(final: Mapping[str, Any], runs: list[Attempt], events: list[Any]) -> None:
    """The job's ledger (``final``: its status at the end) against the ranks' own account
    (:func:`truth` of ``runs``), each bucket and training (productive and lost work
    together) within this run's :class:`Tolerance`, lost work within its own."""
    ranks = truth(runs, final["started_at"])
    bounds = tolerance(final, runs, events)
    wall = final["finished_at"] - final["started_at"]
    ledger = {b: gpu_s / final["world_size"] for b, gpu_s in final["goodput"].items()}
    off = {b: ledger[b] - seconds for b, seconds in ranks.items()}
    table = ", ".join(f"{b} {ledger[b]:.2f} vs {ranks[b]:.2f}" for b in ranks)
    said = f"wall {wall:.1f} s: {table}; tolerance: {bounds}"
    print(f"ledger against the ranks' account: {said}")
    exact = {b: d for b, d in off.items() if b not in ("productive", "lost_work")}
    exact["training"] = off["productive"] + off["lost_work"]
    assert all(abs(d) <= bounds.bucket_s for d in exact.values()), said
    assert abs(off["lost_work"]) <= bounds.lost_work_s, said


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()
