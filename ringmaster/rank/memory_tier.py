"""The memory tier: every few steps each rank's checkpoint shard lands in its node's RAM
(:class:`ringmaster.memory_store.MemoryStore`) and a copy in the RAM of a buddy rank on
the next node of a ring, so a fault redoes a few steps instead of a checkpoint interval.

The copies travel over the ranks' own gloo checkpoint group as point-to-point sends
(``batch_isend_irecv``), not through the node agents: the ranks already hold that group
and its connections, the byte counts are known from the manifest every rank gathers
anyway, and a copy through an agent would add a hop and a second transport to every
snapshot. It runs in the persist thread, so the training loop never waits for it.

Resume: every rank of the new world says which sealed steps its node holds and which of
their files; the ranks pick the newest step whose files the new world holds between them
and that its engine can load at the new world size (a world that shrank or grew reshards
from memory as it would from a durable checkpoint), and each rank assembles the files it
loads (its own, plus what the engine reads of other ranks') from its node's store and,
for the rest, from the rank that holds them. Everything is verified against the manifest
before it is loaded; a step that fails anywhere is given up for the durable tier on every
rank.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ringmaster.checkpoints import FileEntry, Manifest
from ringmaster.memory_store import MemoryStore, node_store
from ringmaster.rank import durable
from ringmaster.rank.coordination import Coordination, Figures
from ringmaster.rank.file_transfer import send_recv

# The snapshot's share of step time the automatic cadence keeps under (the job file's
# promise), and the share it aims at: below the budget by the cost a rank cannot see of
# itself. Measured on a 2-core CPU host from within the same runs (steps near a snapshot
# against the rest, ``bench/snapshot_cost.py``), a cadence aimed at the whole 2 % cost
# 2.7 to 3.1 % of step time where the ranks counted 1.96 to 1.99 %: caches and memory
# bandwidth the snapshot's threads took from training. Aiming a quarter lower keeps what
# the steps feel under the budget.
COST_BUDGET = 0.02
COST_TARGET = 0.015
SMOOTHING = 0.3  # the weight of the newest snapshot's cost in the cadence's average


def shares_cores(device: torch.device, local_ranks: int) -> bool:
    """Whether a snapshot's background work (serialising, hashing, copying) takes CPU
    time from training on this node: the ranks train on the CPU and their threads use
    every core they may run on. On a GPU host the cores are the device's spare."""
    if device.type != "cpu":
        return False
    return len(os.sched_getaffinity(0)) - local_ranks * torch.get_num_threads() < 1


def buddy_ranks(nodes: list[str]) -> tuple[dict[int, int], dict[int, int]]:
    """``nodes[r]`` is rank r's node: the ring by node, as (rank → the rank it copies
    to, rank → the rank it receives from). Rank r copies to the rank with its local index
    on the next node; a node without such a rank, or a world on one node, has none."""
    order: list[str] = []
    local: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in local:
            order.append(node)
        local.setdefault(node, []).append(rank)
    to: dict[int, int] = {}
    if len(order) > 1:
        for i, node in enumerate(order):
            peers = local[order[(i + 1) % len(order)]]
            for index, rank in enumerate(local[node]):
                if index < len(peers):
                    to[rank] = peers[index]
    return to, {dst: src for src, dst in to.items()}


@dataclass
class MemoryTier:
    store: MemoryStore
    coord: Coordination
    nodes: list[str]  # every rank's node
    cadence: Cadence
    to: dict[int, int] = field(init=False)
    source: dict[int, int] = field(init=False)
    # the last restore's parts in seconds (offers, transfer, verify), for the rank's log
    restore_parts: dict[str, float] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.to, self.source = buddy_ranks(self.nodes)

    def room_short(self, figures: list[Figures]) -> str | None:
        """Why a node cannot hold one more snapshot beside the newest (its ranks' files
        and their sources'), from every rank's figures; None when each can."""
        size = [sum(e.size for e in (f.entries or {}).values()) for f in figures]
        for rank, node in enumerate(self.nodes):
            held = [r for r, n in enumerate(self.nodes) if n == node]
            need = sum(size[r] + (size[self.source[r]] if r in self.source else 0) for r in held)
            free = figures[rank].free_bytes
            if free < need:
                return (
                    f"{node} has {free / 1e9:.2f} GB free in {self.store.root.parent.parent}, "
                    f"a snapshot of its ranks and their buddies needs {need / 1e9:.2f} GB"
                )
        return None

    def plan(self, step: int, figures: list[Figures]) -> dict[str, Any] | None:
        """Set the next snapshot after the one at ``step`` from every rank's figures of
        the previous one (none yet: the next step); what changed, for the rank's log."""
        if not figures:
            self.cadence.plan(step, 0.0, 0.0, 0.0)
            return None
        stall_s = max(f.stall_s for f in figures)
        previous_s = max(f.previous_s for f in figures)
        cpu_s = max(f.previous_cpu_s for f in figures)
        step_s = max(f.step_s for f in figures)
        if not self.cadence.plan(step, stall_s, previous_s, step_s, cpu_s):
            return None
        mean = self.cadence.mean_cost_s or 0.0
        cost = mean / (self.cadence.every * step_s) if step_s else 0.0
        return {
            "every_steps": self.cadence.every,
            "stall_s": stall_s,
            "background_s": previous_s,
            "background_cpu_s": cpu_s,
            "step_s": step_s,
            "cost": round(cost, 4),
            "counts_background": self.cadence.contended,
        }

    def seal(
        self,
        step: int,
        files: dict[str, FileEntry],
        ranks: dict[str, list[str]],
        engine: str,
        job: str,
    ) -> None:
        """Copy this rank's files of ``step`` to its buddy, take its source's, and seal the
        step with the manifest every rank gathered."""
        manifest = Manifest(
            step=step,
            world_size=self.coord.world_size,
            engine=engine,
            created=time.time(),
            files=files,
            ranks=ranks,
            job=job,
        )
        self.copy_to_buddy(step, manifest)
        self.store.seal(step, manifest)

    def copy_to_buddy(self, step: int, manifest: Manifest) -> None:
        """Send this rank's files of ``step`` to its buddy and take its source's copy."""
        rank, step_dir = self.coord.rank, self.store.step_dir(step)
        sends, recvs = [], []
        if (dst := self.to.get(rank)) is not None:
            sends = [(step_dir / n, dst) for n in manifest.ranks.get(str(rank), [])]
        if (src := self.source.get(rank)) is not None:
            theirs = manifest.ranks.get(str(src), [])
            recvs = [(step_dir / n, src, manifest.files[n].size) for n in theirs]
        send_recv(sends, recvs, self.coord.group)

    def restore(self, needs: Needs, after: int) -> tuple[Manifest, Path] | None:
        """The newest sealed step past ``after`` that the ranks hold between them and can
        load at this world size, assembled in this rank's restore dir and verified; None
        (on every rank) when there is none. ``needs(manifest, rank)``: the files rank
        loads, None when it cannot load that step (the engine does not reshard it)."""
        began = time.perf_counter()
        sealed = self.store.sealed()
        offers = self.coord.all_gather(
            {step: (m, present) for step, (m, present) in sealed.items() if step > after}
        )
        chosen = _choose(offers, self.coord.world_size, needs)
        self.restore_parts = {"offers_s": round(time.perf_counter() - began, 3)}
        if chosen is None:
            return None
        step, manifest, plan = chosen
        restore = self.store.restore_dir(self.coord.rank) / durable.step_dir_name(step)
        mine = needs(manifest, self.coord.rank) or []
        try:
            began = time.perf_counter()
            self._assemble(step, manifest, plan, restore, mine)
            self.restore_parts["transfer_s"] = round(time.perf_counter() - began, 3)
            began = time.perf_counter()
            ok = all(durable.verify(restore, manifest, name) for name in mine)
            self.restore_parts["verify_s"] = round(time.perf_counter() - began, 3)
        except OSError:
            ok = False
        if not self.coord.all_true(ok):
            self.discard_restore()
            return None
        return manifest, restore

    def _assemble(
        self,
        step: int,
        manifest: Manifest,
        plan: list[tuple[str, int, int]],
        restore: Path,
        mine: list[str],
    ) -> None:
        rank = self.coord.rank
        fetched = {name for name, _, to in plan if to == rank}
        for name in mine:
            if name not in fetched:
                self.store.link_or_copy(step, name, restore / name)
        step_dir = self.store.step_dir(step)
        sends = [(step_dir / name, to) for name, frm, to in plan if frm == rank]
        recvs = [
            (restore / name, frm, manifest.files[name].size) for name, frm, to in plan if to == rank
        ]
        send_recv(sends, recvs, self.coord.group)

    def discard_restore(self) -> None:
        shutil.rmtree(self.store.restore_dir(self.coord.rank), ignore_errors=True)


Offer = dict[int, tuple[Manifest, list[str]]]
Needs = Callable[[Manifest, int], list[str] | None]


def _choose(
    offers: list[Offer], world: int, needs: Needs
) -> tuple[int, Manifest, list[tuple[str, int, int]]] | None:
    """The newest step every rank of a world of ``world`` can assemble and load (at the
    world size that wrote it or, where the engine reshards it, at another), and the
    transfers that assemble it: (file, from rank, to rank), the same list on every rank."""
    steps = sorted({s for offer in offers for s in offer}, reverse=True)
    for step in steps:
        holders: dict[str, list[int]] = {}
        manifest = None
        for rank, offer in enumerate(offers):
            if step in offer:
                manifest = offer[step][0]
                for name in offer[step][1]:
                    holders.setdefault(name, []).append(rank)
        if manifest is None:
            continue
        plan: list[tuple[str, int, int]] = []
        complete = True
        for rank in range(world):
            names = needs(manifest, rank)
            if names is None:
                complete = False
                break
            for name in names:
                have = holders.get(name, [])
                if rank in have:
                    continue
                if not have:
                    complete = False
                    break
                plan.append((name, min(have), rank))
            if not complete:
                break
        if complete:
            return step, manifest, plan
    return None


class Cadence:
    """Which steps get a memory snapshot. Fixed (``every``), or automatic: after each
    snapshot, from the previous one's figures (the slowest rank's blocking time and
    background time, and step time), as few steps apart as keeps the blocking time at
    :data:`COST_TARGET` of step time (under :data:`COST_BUDGET`) and the background work
    out of the next snapshot's way, at most ``cap`` (the durable interval). Where the
    background work competes with training for the cores (``contended``:
    :func:`shares_cores` on some rank), its CPU time is a cost too, and counts with the
    blocking time (an average over recent snapshots: :data:`SMOOTHING`). Every rank
    computes the same figures at the same step (they come from a gather), so every rank
    snapshots the same steps."""

    def __init__(self, every: int | None, cap: int, contended: bool = False) -> None:
        self.fixed = every
        self.contended = contended
        self.cap = max(1, cap)
        self.every = every or 1
        self.next: int | None = None  # None: at the first step offered
        # one snapshot's cost, averaged over the recent ones: a garbage collection that
        # happens to run in one snapshot's thread must not space out the next twenty
        self.mean_cost_s: float | None = None

    def due(self, step: int) -> bool:
        return self.next is None or step >= self.next

    def plan(
        self, step: int, stall_s: float, persist_s: float, step_s: float, cpu_s: float = 0.0
    ) -> bool:
        """Set the next snapshot after the one at ``step`` (``persist_s``: the background
        work's wall time, ``cpu_s``: its CPU time); whether the interval changed."""
        before = self.every
        if self.fixed is None and step_s > 0:
            cost_s = self.cost_s(stall_s, cpu_s)
            mean = self.mean_cost_s
            self.mean_cost_s = (
                cost_s if mean is None else (1 - SMOOTHING) * mean + SMOOTHING * cost_s
            )
            by_cost = math.ceil(self.mean_cost_s / (COST_TARGET * step_s))
            by_overlap = math.ceil(persist_s / step_s)
            self.every = min(self.cap, max(1, by_cost, by_overlap))
        self.next = step + self.every
        return self.every != before

    def cost_s(self, stall_s: float, cpu_s: float) -> float:
        """What one snapshot costs training: the time it blocked the loop, and where the
        cores are shared the CPU time its background work took from them."""
        return stall_s + (cpu_s if self.contended else 0.0)


def build(
    coord: Coordination,
    job_id: str,
    node: str,
    every: int | None,
    cap: int,
    contended: bool,
    first_attempt: bool = False,
) -> tuple[MemoryTier | None, str]:
    """The job's memory tier on this rank, and what to log of it; every rank of the job
    calls this at the same point (it gathers every rank's node). None, with the reason,
    when some rank's node has no writable ``/dev/shm``. ``contended``: this rank's
    :func:`shares_cores`; the cadence counts background work if any rank's is.
    ``first_attempt``: the job's first launch, which has no earlier attempt to resume
    from, so whatever the node's store holds under this job's id is another run's and is
    cleared (before the gathers below: no rank of this job writes before them)."""
    root = node_store(job_id, node)
    if first_attempt and root is not None:
        MemoryStore(root).clear()
    usable = coord.all_true(root is not None)
    contended = not coord.all_true(not contended)
    nodes: list[str] = coord.all_gather(node)
    if not usable or root is None:
        return None, "off: a node of the job has no writable /dev/shm"
    tier = MemoryTier(MemoryStore(root), coord, nodes, Cadence(every, cap, contended))
    buddy = tier.to.get(coord.rank)
    copies = f"a copy on rank {buddy} ({nodes[buddy]})" if buddy is not None else "no copy"
    counted = ", background work counted (it shares the cores)" if contended else ""
    return tier, f"on: {root}, {copies}{counted}"
