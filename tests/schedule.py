"""The order the suite runs in, so that two workers end together.

pytest-xdist's ``worksteal`` hands each worker an equal share of the collected list by
count, in order, and a worker that runs out steals the tail of the busiest one's queue.
The scenarios cost minutes and the unit tests seconds, so which worker starts which
scenario decides when the suite ends: sorted slowest first, the first worker's share
would hold every scenario. Here the scenarios are dealt to the workers longest first, each
to the worker with the least work so far (LPT), and each worker's share is its scenarios,
longest first, then unit tests up to its count: every worker starts on its longest work
while there is time to balance the rest, and the unit tests fill in.

A scenario's cost is its ``cost`` marker (seconds measured on a 2-core machine with the
suite running, so only their proportions matter); a slow test without one counts as
:data:`SLOW_DEFAULT_S`, any other test as :data:`UNIT_S`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TypeVar

import pytest

SLOW_DEFAULT_S = 60.0
UNIT_S = 0.5
T = TypeVar("T")


def cost(item: pytest.Item) -> float:
    marker = item.get_closest_marker("cost")
    if marker is not None:
        return float(marker.args[0])
    return SLOW_DEFAULT_S if item.get_closest_marker("slow") is not None else UNIT_S


def deal(items: Sequence[T], costs: Sequence[float], slow: Sequence[bool], workers: int) -> list[T]:
    """``items`` laid out for ``workers`` contiguous equal shares (see the module)."""
    if workers < 2:
        order = sorted(range(len(items)), key=lambda i: (not slow[i], -costs[i]))
        return [items[i] for i in order]
    heavy = sorted((i for i in range(len(items)) if slow[i]), key=lambda i: -costs[i])
    light = [i for i in range(len(items)) if not slow[i]]
    loads = [(0.0, w) for w in range(workers)]
    shares: list[list[int]] = [[] for _ in range(workers)]
    for i in heavy:
        load, w = heapq.heappop(loads)
        shares[w].append(i)
        heapq.heappush(loads, (load + costs[i], w))
    # xdist sends the first worker len // workers, the next len // (workers - 1) of the
    # rest, ...: each share is filled with unit tests to exactly that count
    remaining, laid = len(items), []
    for w in range(workers):
        size = remaining // (workers - w)
        fill = max(0, size - len(shares[w]))
        laid += shares[w] + light[:fill]
        light = light[fill:]
        remaining -= size
    laid += light  # only when scenarios outnumber a share: they stay in front
    return [items[i] for i in laid]
