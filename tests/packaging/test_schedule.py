"""The suite's order for xdist's worksteal (tests/schedule.py): each worker's equal share
by count starts with its scenarios, longest first, dealt so the shares' costs balance."""

from __future__ import annotations

from tests.schedule import deal


def shares(laid: list[str], workers: int) -> list[list[str]]:
    """How xdist splits the list: the first worker len // workers, then of the rest."""
    out, rest = [], list(laid)
    for w in range(workers):
        size = len(rest) // (workers - w)
        out.append(rest[:size])
        rest = rest[size:]
    return out


def test_scenarios_are_dealt_longest_first_to_the_least_loaded_share() -> None:
    costs = {"a": 200.0, "b": 150.0, "c": 120.0, "d": 100.0, "e": 30.0}
    units = [f"u{i}" for i in range(20)]
    items = ["e", "u0", "a", *units[1:], "d", "b", "c"]
    laid = deal(items, [costs.get(i, 0.5) for i in items], [i in costs for i in items], 2)
    assert sorted(laid) == sorted(items)
    first, second = shares(laid, 2)
    assert first[:2] == ["a", "d"] and second[:3] == ["b", "c", "e"]
    assert all(i.startswith("u") for i in first[2:] + second[3:])
    load = [sum(costs.get(i, 0) for i in share) for share in (first, second)]
    assert abs(load[0] - load[1]) <= 60


def test_one_worker_runs_the_scenarios_first_longest_first() -> None:
    items = ["u0", "short", "u1", "long"]
    laid = deal(items, [0.5, 10.0, 0.5, 90.0], [False, True, False, True], 1)
    assert laid == ["long", "short", "u0", "u1"]
