"""The memory tier's cost read off one run with the tier on: the steps a snapshot can
slow (its blocking part, then its background work) against the steps of the same run
that no snapshot is near. Launch-to-launch noise on a 2-core machine (±10 % between two
runs of the same job) is far larger than the 2 % being measured; within one run it
cancels, because both kinds of step share the run's placement, memory and neighbours.
Pure arithmetic, unit-tested in ``tests/bench``."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence


def snapshot_steps(memory_steps: Sequence[int | None]) -> list[int]:
    """The steps snapshots were taken at: each newest sealed step rank 0 reported."""
    return sorted({s for s in memory_steps if s is not None})


def in_run_ratio(steps: Sequence[int], times: Sequence[float], snapshots: Sequence[int]) -> float:
    """Step time with the snapshots over without, from one run: ``times[i]`` is when step
    ``steps[i]`` ended. The interval ending at step k is near the snapshot at s when
    s < k <= s + half the gap to the next snapshot (the last: to the one before); the
    mean of the other intervals is the run's step time without the tier, and what the
    near ones took beyond it, summed, is what the snapshots cost. A mean on both sides:
    step times are skewed (a median baseline would charge the skew to the snapshots)."""
    ends = itertools.pairwise(zip(steps, times, strict=True))
    intervals = {k: t - prev for (_, prev), (k, t) in ends}
    cuts = sorted(s for s in snapshots if s + 1 in intervals)
    if len(cuts) < 2:
        raise ValueError("fewer than two snapshots in the run: nothing to compare")
    gaps = [b - a for a, b in itertools.pairwise(cuts)]
    near = {
        k
        for s, gap in zip(cuts, [*gaps, gaps[-1]], strict=True)
        for k in range(s + 1, s + 1 + gap // 2)
    }
    clean = [d for k, d in intervals.items() if k not in near]
    if max(gaps) < 2 or not clean:
        raise ValueError("snapshots every step leave no steps without one to compare with")
    baseline = statistics.fmean(clean)
    excess = sum(d - baseline for k, d in intervals.items() if k in near)
    return 1 + excess / (baseline * len(intervals))
