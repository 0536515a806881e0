"""The pure half of ``bench/soak.py``: its arguments, the seeded fault schedule, what each
fault does and undoes, and the figures read off a finished soak. No processes, no I/O, so
that the schedule a seed gives and the arithmetic of the report are unit-tested.

A fault is one of ``MIX``. Its actions are ``coordinatorctl inject`` forms on the target
node (``proto/faults.py``), or one of ``BENCH_ACTIONS``, which the soak carries out itself
because no inject form does: killing and restarting the leading coordinator, freezing and
thawing the bus.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

REPAIR_S = 25.0  # a lost node comes back this long after it died
FREEZE_S = 12.0  # the bus stays frozen this long
RESTART_S = 5.0  # a killed leader is started again (as a standby) after this long
RANK_KILL_S = 10.0  # after an agent restart, one of its ranks is killed this long after
NVME_S = 10.0  # an NVMe latency spike lasts this long
UNDO_S = 20.0  # a straggler or a clock offset is undone after this long, if not handled
STUCK_S = 30.0  # longer than this without a step (not paused, not waiting): stuck
# s: at the end, how long the nodes get to be ready again (a notice that passed: its
# deadline, the agent's minute, its probation; a lost node: its repair and probation)
SETTLE_S = 180.0

# fault → (low, high) of its drawn value, or None where it takes none
MIX: dict[str, tuple[float, float] | None] = {
    "rank-kill": None,
    "node-loss": None,
    "hang": None,
    "straggler": (2.0, 6.0),  # slow=F
    "spot-notice": (10.0, 25.0),  # seconds to the preemption, withdrawn 10 s after it
    "notice-passes": (10.0, 25.0),  # the same, never withdrawn: the machine is not taken
    "nvme-spike": (500.0, 5000.0),  # µs
    "clock-offset": (20.0, 200.0),  # ms, either sign
    "nan-loss": None,
    "leader-kill": None,
    "bus-freeze": None,
    "agent-restart": None,
}
# faults of the cluster, not of a node → what they hit
CLUSTER_FAULTS = {"leader-kill": "the leader", "bus-freeze": "nats-server"}
BENCH_ACTIONS = ("kill-leader", "start-coordinator", "freeze-bus", "thaw-bus")


@dataclass(frozen=True)
class Planned:
    at: float  # seconds after the soak started
    fault: str
    pick: float  # in [0, 1): which of the job's nodes, by position
    value: float  # the drawn value (MIX); 0 where the fault takes none


def schedule(minutes: float, every: float, seed: int) -> list[Planned]:
    """One fault every ``every`` s from ``every`` on, while within ``minutes``. The kinds are
    drawn from shuffled rounds of the whole mix, so a soak of ``len(MIX)`` faults sees
    every kind once, and a seed always gives the same soak."""
    rng = random.Random(seed)
    out: list[Planned] = []
    bag: list[str] = []
    at = every
    while at < minutes * 60:
        if not bag:
            bag = list(MIX)
            rng.shuffle(bag)
        fault = bag.pop()
        span = MIX[fault]
        value = round(rng.uniform(*span)) if span else 0.0
        if fault == "clock-offset" and rng.random() < 0.5:
            value = -value
        out.append(Planned(at, fault, rng.random(), float(value)))
        at += every
    return out


def actions(p: Planned) -> tuple[str, list[tuple[float, str]]]:
    """The fault's first action, and its follow-ups as (seconds after the fault, action)."""
    v = f"{p.value:g}"
    match p.fault:
        case "rank-kill":
            return "kill-worker", []
        case "node-loss":
            return "lose-node", [(REPAIR_S, "restart-agent")]  # the machine repaired
        case "hang":
            return "hang", []
        case "straggler":
            return f"slow={v}", [(UNDO_S, "slow=1")]
        case "spot-notice":
            return f"spot-notice={v}", [(p.value + 10.0, "clear")]
        case "notice-passes":
            return f"spot-notice={v}", []  # the agent finds it passed, a minute on
        case "nvme-spike":
            return f"nvme-latency={v}", [(NVME_S, "clear")]
        case "clock-offset":
            return f"clock-offset={v}", [(UNDO_S, "clock-offset=0")]
        case "nan-loss":
            return "nan-loss", []
        case "leader-kill":
            return "kill-leader", [(RESTART_S, "start-coordinator")]
        case "bus-freeze":
            return "freeze-bus", [(FREEZE_S, "thaw-bus")]
        case "agent-restart":
            return "restart-agent", [(RANK_KILL_S, "kill-worker")]
    raise ValueError(f"unknown fault {p.fault!r}")


def target(nodes: Sequence[str], pick: float) -> str | None:
    return nodes[min(int(pick * len(nodes)), len(nodes) - 1)] if nodes else None


def reaction(kinds: Sequence[str]) -> str:
    """The job's reaction from the ``job.*`` kinds that followed a fault, in order, each
    once; routine ones (checkpoints, bandwidth reports) are no reaction."""
    seen: list[str] = []
    for kind in kinds:
        name = kind.removeprefix("job.")
        if kind.startswith("job.") and name not in ("checkpointed", "bandwidth", *seen):
            seen.append(name)
    return "/".join(seen) or "none"


def back_to_training(
    starts: Sequence[float], steps: Sequence[float], at: float, until: float, restarted: bool
) -> float | None:
    """Seconds from a fault at ``at`` to training again, from the ranks' wall times. If the
    fault cost a restart, to the first step of the first attempt started after it, whenever
    that came (None: not yet): a step the doomed attempt still finished is not training
    again. Else to the first step of an attempt started before ``until`` (the next fault),
    or, with none, to the first step after the fault (training went on)."""
    start = next((t for t in starts if at < t and (restarted or t < until)), None)
    if start is None:
        return (
            None if restarted else next((round(t - at, 1) for t in steps if at < t < until), None)
        )
    return next((round(t - at, 1) for t in steps if t > start), None)


def cost(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, float]:
    """GPU-seconds each bucket but ``productive`` gained from the ledger ``before`` a fault
    to the ledger ``after`` it (read as the next fault came): what the window cost. A
    bucket that shrank (a stall moved to ``checkpoint_stall``) counts as nothing."""
    if not before or not after:
        return {}
    gained = {k: round(v - before.get(k, 0.0), 1) for k, v in after.items() if k != "productive"}
    return {k: v for k, v in gained.items() if v > 0}


def cost_by_fault(faults: Sequence[Mapping[str, Any]]) -> list[tuple[str, float, dict[str, float]]]:
    """Each fault kind's windows' costs summed, bucket by bucket, the dearest kind first:
    (kind, GPU-s in all, GPU-s per bucket)."""
    sums: dict[str, dict[str, float]] = {}
    for fault in faults:
        into = sums.setdefault(fault["fault"], {})
        for bucket, gpu_s in (fault.get("cost") or {}).items():
            into[bucket] = round(into.get(bucket, 0.0) + gpu_s, 1)
    totals = [(kind, round(sum(b.values()), 1), b) for kind, b in sums.items()]
    return sorted(totals, key=lambda t: (-t[1], t[0]))


def longest_stall(
    steps: Sequence[float], excused: Sequence[tuple[float, float]], start: float, end: float
) -> tuple[float, float]:
    """(seconds, when it began) of the longest stretch of [start, end] with no step in it
    and not excused (the job paused or waiting for nodes); times are Unix wall times."""
    inside = {s for s in steps if start < s < end}
    edges = {t for span in excused for t in span if start < t < end}
    best, began = 0.0, start
    run: float | None = None  # where the stretch under way began
    for a, b in pairwise(sorted({start, end, *inside, *edges})):
        if any(s <= a and b <= e for s, e in excused):
            run = None
            continue
        if run is None or a in inside:
            run = a
        if b - run > best:
            best, began = b - run, run
    return round(best, 2), began


def not_ready(nodes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The live nodes (their agents beating: not away, not lost) that are not ready, each
    with its state, whether it is held for a person, and why (``why``: the status table's
    notes, given by the caller)."""
    return [
        {"node": n["id"], "state": n["state"], "held": bool(n.get("held")), "why": n["why"]}
        for n in nodes
        if n["state"] not in ("ready", "away", "lost")
    ]


def unsettled(nodes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Of :func:`not_ready`, those nothing deliberate keeps out: a node held for a person
    is a verdict on repeated faults (the soak may well inject three on one node), one still
    draining or degraded after :data:`SETTLE_S` is a node the soak left behind."""
    return [n for n in not_ready(nodes) if not n["held"]]


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/soak.py",
        description="A chaos soak: one job on a local cluster, a random fault every few "
        "seconds from the whole mix, and what each cost.",
    )
    p.add_argument("--minutes", type=positive, required=True, help="faults for this long")
    p.add_argument("--every", type=positive, required=True, help="seconds between faults")
    p.add_argument("--seed", type=int, required=True, help="the schedule's seed")
    p.add_argument("--json", metavar="OUT", help="write the whole report here as JSON")
    p.add_argument("--dir", metavar="DIR", help="the cluster's directory (default: a new one)")
    return p
