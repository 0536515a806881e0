"""Preflight bandwidth check: before a multi-node job's first step, time an all-reduce over
each link between its nodes and report every node's bus bandwidth to the coordinator.

Why per link and not one all-reduce over the whole job: a collective's time is the same on
every rank, so it can say the job is slow but not which node is. Each node's local leader
(its first rank) instead all-reduces a fixed buffer with one peer node at a time, around a
ring (node i with node i+1; two nodes have one link), one link after another so that no two
measurements share a NIC. A node's figure is its best link: a healthy node has at least one
healthy link, while a node with a bad NIC or a loose PCIe slot slows every link it is on.
With two nodes both figures are the one link's, so only three nodes and more can single a
node out (:func:`proto.progress.slow_nodes`). A node singled out has its links measured
once more, and keeps the better of its two figures: a bad NIC is slow both times, while
a moment of contention (a burst of other traffic, or other work on the host's cores
stretching one measurement) is not, and refusing a healthy node costs the job a restart.

Figures follow NCCL-tests' definitions (nccl-tests ``doc/PERFORMANCE.md``):
``algbw = S / t`` for a buffer of ``S`` bytes all-reduced in ``t`` seconds, and
``busbw = algbw × 2(n-1)/n`` for ``n`` ranks, which for a 2-rank link equals ``algbw``.
They are reported in GB/s (10⁹ bytes a second).

The cost is bounded: one 1-element all-reduce to set each link's communicator up, one
warm-up of the full buffer, then at most 3 timed rounds, fewer when the warm-up says they
would overrun the link's share of :data:`BUDGET_S`.

``RINGMASTER_SIM_SLOW_NODE=NODE:SECONDS[:PASSES]`` (in the job's ``[job] env``) sleeps
``SECONDS`` inside each of that node's timed rounds, so the link looks slow from both ends,
as a bad link does; with ``PASSES`` only in the first that many measurements (``1``: a
passing slowdown). It exists only to rehearse the coordinator's reaction on a simulated
cluster and is honoured only where the agent sets ``RINGMASTER_SIMULATED=1``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from proto.progress import BandwidthChecked, slow_nodes
from ringmaster import rank_env
from ringmaster.rank.log import Log

CPU_BYTES = 16 << 20  # gloo over loopback or TCP: enough to leave latency behind
CUDA_BYTES = 256 << 20  # NCCL: large enough to reach the bus's plateau
TIMED = 3
BUDGET_S = 3.0  # the timed rounds of every link together


def node_count(env: Mapping[str, str], world_size: int, local_world_size: int) -> int:
    """How many nodes the job spans: ``GROUP_WORLD_SIZE`` as the rendezvous sets it, else
    the ranks divided among nodes of ``LOCAL_WORLD_SIZE`` (plain torchrun)."""
    if "GROUP_WORLD_SIZE" in env:
        return int(env["GROUP_WORLD_SIZE"])
    return max(1, world_size // max(1, local_world_size))


def ring(nodes: int) -> list[tuple[int, int]]:
    """The links measured, as node index pairs, in the order they are measured."""
    if nodes < 2:
        return []
    if nodes == 2:
        return [(0, 1)]
    return [(i, (i + 1) % nodes) for i in range(nodes)]


def bus_gbps(size_bytes: int, seconds: float, ranks: int = 2) -> float:
    """NCCL-tests' all-reduce busbw in GB/s: ``S / t × 2(n-1)/n``."""
    return size_bytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def sim_delay(env: Mapping[str, str], node: str, measurement: int = 0) -> float:
    """Seconds this node adds to each timed round of its ``measurement``-th measurement
    (from 0; simulated nodes only, see above)."""
    knob = env.get("RINGMASTER_SIM_SLOW_NODE", "")
    if env.get(rank_env.SIMULATED) != "1" or ":" not in knob:
        return 0.0
    name, seconds, *passes = knob.split(":", 2)
    if name != node or (passes and measurement >= int(passes[0])):
        return 0.0
    return float(seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_link(
    group: dist.ProcessGroup, device: torch.device, size: int, budget_s: float, delay_s: float
) -> float:
    """Seconds one all-reduce of ``size`` bytes takes on the 2-rank ``group``; both ends
    agree on the round count and the result (the slower end's time)."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)  # set the communicator up
    buf = torch.zeros(size // 4, dtype=torch.float32, device=device)

    def rounds(count: int) -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(count):
            time.sleep(delay_s)
            dist.all_reduce(buf, group=group)
        _sync(device)
        return (time.perf_counter() - start) / count

    def slower(seconds: float) -> float:
        both = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        return float(both.item())

    warm = slower(rounds(1))
    count = min(TIMED, int(budget_s / warm))
    return slower(rounds(count)) if count else warm


def check(
    rank: int,
    world_size: int,
    local_world_size: int,
    device: torch.device,
    gather_group: dist.ProcessGroup | None,
    env: Mapping[str, str],
    ratio: float,
    log: Log,
) -> BandwidthChecked | None:
    """Measure every link (a collective: every rank of the job calls it). Rank 0 gets the
    message for the coordinator; every other rank, and every rank of a 1-node job, None.
    ``gather_group`` is a gloo group, for the one object gather."""
    nodes = node_count(env, world_size, local_world_size)
    links = ring(nodes)
    if not links:
        if rank == 0:
            log("preflight_bandwidth", skipped="single node")
        return None
    started = time.monotonic()
    index = rank // local_world_size
    name = env.get(rank_env.NODE, f"node{index}")

    def measure(links: list[tuple[int, int]], measurement: int) -> dict[int, tuple[str, float]]:
        """Each node's best link of ``links``, by node index, on every rank."""
        delay = sim_delay(env, name, measurement)
        size = CUDA_BYTES if device.type == "cuda" else CPU_BYTES
        mine: list[float] = []
        for a, b in links:  # every rank creates every group, in the same order
            group = dist.new_group(ranks=[a * local_world_size, b * local_world_size])
            if rank % local_world_size == 0 and index in (a, b):
                seconds = _time_link(group, device, size, BUDGET_S / len(links), delay)
                mine.append(bus_gbps(size, seconds))
            if group != dist.GroupMember.NON_GROUP_MEMBER:  # NCCL communicators hold memory
                dist.destroy_process_group(group)
        found: list[tuple[int, str, float] | None] = [None] * world_size
        said = (index, name, max(mine)) if mine else None
        dist.all_gather_object(found, said, group=gather_group)
        return {i: (node, gbps) for i, node, gbps in (f for f in found if f is not None)}

    first = measure(links, 0)
    flagged = slow_nodes({node: gbps for node, gbps in first.values()}, ratio)
    suspects = {i for i, (node, _) in first.items() if node in flagged}
    again = [link for link in links if set(link) & suspects]
    second = measure(again, 1) if again else {}  # every rank knows ``first``: all agree
    if rank != 0:
        return None
    node_gbps = {
        node: max(gbps, second.get(i, ("", 0.0))[1]) for i, (node, gbps) in sorted(first.items())
    }
    if again:
        log("preflight_bandwidth", measured_again=",".join(sorted(flagged)))
    slow = slow_nodes(node_gbps, ratio)
    median = statistics.median(node_gbps.values())
    seconds = time.monotonic() - started
    for node, gbps in node_gbps.items():
        log("preflight_bandwidth", node=node, busbw_gbps=gbps, slow=node in slow)
    log("preflight_bandwidth", median_gbps=median, slow=",".join(slow) or "-", seconds=seconds)
    return BandwidthChecked(
        node_gbps=node_gbps, median_gbps=median, slow=sorted(slow), seconds=seconds
    )
