"""Where a restarted job will resume: the memory tier's newest snapshot, when the ranks
of the new world can still reach a copy of every shard, else the durable checkpoint.

The ranks decide for themselves (:mod:`trainer.memory_tier`, from what their nodes
hold); this is the same rule from what the coordinator knows, so that ``job.restarted``
says where the job is expected to resume. Each rank's snapshot lives on its own node and
on the next node of the job's ring (the order of ``job.nodes``), so a step survives while
no node the new world lacks is followed in the ring by another it lacks, at the same
world size. Only rank 0's newest sealed step is known here; a copy that turns out to be
unreadable makes the ranks fall back further, and their ``resumed_from`` line says so.
"""

from __future__ import annotations

from typing import Literal

Tier = Literal["memory", "durable"]


def expected_resume(
    old_nodes: list[str],
    new_nodes: list[str],
    same_world_size: bool,
    memory_step: int | None,
    durable_step: int | None,
) -> tuple[Tier, int]:
    durable = durable_step or 0
    if memory_step is None or memory_step <= durable or not same_world_size or not old_nodes:
        return "durable", durable
    kept = set(new_nodes)
    ring = len(old_nodes)
    for i, node in enumerate(old_nodes):
        buddy = old_nodes[(i + 1) % ring] if ring > 1 else None
        if node not in kept and (buddy is None or buddy not in kept):
            return "durable", durable
    return "memory", memory_step
