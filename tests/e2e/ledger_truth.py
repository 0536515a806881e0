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


def redone_seconds(run: Attempt, past: int) -> float:
    """Training seconds ``run`` spent on its steps after step ``past``: their count × the
    median of their own gaps from the step before (the first step's: the attempt's
    median), each less the pauses and checkpoint stalls inside it. Their own gaps, since
    the steps just before a fault ran under that moment's load, not the attempt's average;
    their median, since a gap that held something else (an evaluation, a save of the
    loop's own) is not a step's time."""
    median = statistics.median(s for _, _, s in run.steps)
    gaps, before = [], run.steps[0][0] - median
    for wall, step, _ in run.steps:
        if step > past:
            paused = sum(b - a for a, b in run.pauses if before <= a and b <= wall)
            stalled = sum(s for at, s in run.stalls if before < at <= wall)
            gaps.append(max(0.0, wall - before - paused - stalled))
        before = wall
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


def check_ledger(final: Mapping[str, Any], ranks: dict[str, float]) -> None:
    """The job's ledger (``final``: its status at the end) against the ranks' own account
    (:func:`truth`). Each bucket within 1 % of the wall time plus a second per restart: a
    boundary moves when the coordinator receives the message that marks it, a delivery
    later than the rank's own stamp, on a loaded machine up to about a second each.
    Training (productive and lost work together) within the same bound; lost work (the
    redone steps × the time per step, which swings with the machine's load in a job this
    short) within 5 % of the wall time. Productive is training less lost work: bounded
    by both."""
    wall = final["finished_at"] - final["started_at"]
    ledger = {b: gpu_s / final["world_size"] for b, gpu_s in final["goodput"].items()}
    off = {b: ledger[b] - seconds for b, seconds in ranks.items()}
    table = ", ".join(f"{b} {ledger[b]:.2f} vs {ranks[b]:.2f}" for b in ranks)
    exact = {b: d for b, d in off.items() if b not in ("productive", "lost_work")}
    exact["training"] = off["productive"] + off["lost_work"]
    bound = 0.01 * wall + 1.0 * final["restarts"]
    assert all(abs(d) <= bound for d in exact.values()), f"wall {wall:.1f} s: {table}"
    assert abs(off["lost_work"]) <= 0.05 * wall, f"wall {wall:.1f} s: {table}"
