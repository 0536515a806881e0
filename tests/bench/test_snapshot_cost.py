"""The in-run cost of the memory tier (``bench/snapshot_cost.py``): arithmetic only."""

from __future__ import annotations

import random

import pytest

from bench.snapshot_cost import in_run_ratio, snapshot_steps


def _run(slow: dict[int, float], n: int = 40, step_s: float = 0.1) -> tuple[list[int], list[float]]:
    steps, times, t = [], [], 0.0
    for k in range(n):
        t += step_s + slow.get(k, 0.0)
        steps.append(k)
        times.append(t)
    return steps, times


def test_the_snapshots_are_each_newest_sealed_step_once() -> None:
    assert snapshot_steps([None, None, 10, 10, 10, 20, 20, None]) == [10, 20]


def test_the_time_a_snapshot_adds_to_the_steps_after_it_is_its_cost() -> None:
    # snapshots after steps 10 and 20 each add 50 ms to the next interval and 30 to the one
    # after: 160 ms over 39 intervals of 100 ms
    steps, times = _run({11: 0.05, 12: 0.03, 21: 0.05, 22: 0.03})
    assert in_run_ratio(steps, times, [10, 20]) == pytest.approx(1 + 0.16 / 3.9)


def test_no_extra_time_costs_nothing_however_skewed_the_step_times() -> None:
    steps, times = _run({})
    assert in_run_ratio(steps, times, [10, 20, 30]) == pytest.approx(1.0)
    # long-tailed noise the same near snapshots and away from them: no cost, though its
    # mean is well above its median
    noise = random.Random(7)
    steps, times = _run({k: noise.expovariate(1 / 0.02) for k in range(20_000)}, n=20_000)
    assert in_run_ratio(steps, times, list(range(10, 20_000, 20))) == pytest.approx(1.0, abs=0.005)


def test_too_few_snapshots_or_one_every_step_are_refused() -> None:
    steps, times = _run({})
    with pytest.raises(ValueError, match="fewer than two"):
        in_run_ratio(steps, times, [10])
    with pytest.raises(ValueError, match="every step"):
        in_run_ratio(steps, times, list(range(5, 30)))
