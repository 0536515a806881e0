"""Admission and the rendezvous plan. Pure functions over the registry's view.

Admission takes healthy nodes that are not busy, in node-id order, and says why each
other node was skipped. The master (node 0, global rank 0) is the first admitted node in
that order: a stated, reproducible rule, so a restart with the same nodes picks the same
master. Ranks of one node are contiguous. The environment is exactly torchrun's, with
MASTER_ADDR an IP address (no DNS on the critical path).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from coordinator.registry import NodeInfo
from proto.commands import RankSpec


@dataclass
class Admission:
    chosen: list[NodeInfo]
    skipped: dict[str, str] = field(default_factory=dict)
    spares: list[str] = field(default_factory=list)  # admissible nodes held for the job


def admit(
    nodes: list[NodeInfo],
    want: int,
    ranks_per_node: int,
    busy: set[str],
    exclude: Mapping[str, str],
    *,
    minimum: int | None = None,
    spares: int = 0,
) -> Admission:
    """Up to ``want`` nodes, at least ``minimum`` (default ``want``), or none; then up to
    ``spares`` more held ready for the job. ``busy``: other jobs' nodes and spares;
    ``exclude``: nodes left out of this job, with why (:mod:`coordinator.exclusion`)."""
    usable: list[NodeInfo] = []
    skipped: dict[str, str] = {}
    for node in sorted(nodes, key=lambda n: n.id):
        reason = _refusal(node, ranks_per_node, busy, exclude)
        if reason:
            skipped[node.id] = reason
        else:
            usable.append(node)
    chosen = usable[:want]
    if len(chosen) < (want if minimum is None else min(minimum, want)):
        return Admission(chosen=[], skipped=skipped)
    return Admission(chosen, skipped, [n.id for n in usable[want : want + spares]])


def _refusal(
    node: NodeInfo, ranks_per_node: int, busy: set[str], exclude: Mapping[str, str]
) -> str:
    if node.id in exclude:
        return exclude[node.id]
    if node.id in busy:
        return "busy with another job"
    if node.cordoned_by:
        return f"cordoned by {node.cordoned_by}"
    if node.suspect_at is not None:
        return "its agent did not answer a ping (admitted again at its next heartbeat)"
    if not node.preflight_ok:
        return "preflight failed"
    if not node.topology_ok:
        return "GPU topology degraded"
    if not node.healthy:
        why = node.why_not_healthy()
        return f"node is {node.state.value}" + (f" ({why})" if why else "")
    if node.gpus and node.gpus < ranks_per_node:
        return f"has {node.gpus} GPUs, job needs {ranks_per_node} per node"
    return ""


@dataclass
class NodePlan:
    node: str
    ranks: list[RankSpec]
    env: dict[str, str]


def plan(
    nodes: list[NodeInfo], ranks_per_node: int, master_port: int, job_env: dict[str, str]
) -> list[NodePlan]:
    world = len(nodes) * ranks_per_node
    master = nodes[0]
    base = {
        "MASTER_ADDR": master.addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(ranks_per_node),
        "GROUP_WORLD_SIZE": str(len(nodes)),
        "OMP_NUM_THREADS": "1",
        "NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        **job_env,
    }
    plans = []
    for index, node in enumerate(nodes):
        ranks = [
            RankSpec(
                rank=index * ranks_per_node + local,
                local_rank=local,
                cpus=cpu_slice(local, ranks_per_node, node.cpus),
            )
            for local in range(ranks_per_node)
        ]
        env = {**base, "GROUP_RANK": str(index), "ROLE_RANK": str(index)}
        plans.append(NodePlan(node=node.id, ranks=ranks, env=env))
    return plans


def cpu_slice(local_rank: int, ranks_per_node: int, cpus: int) -> list[int]:
    """An even share of the node's cores per local rank (empty: no pinning)."""
    share = cpus // ranks_per_node
    if share < 1:
        return []
    return list(range(local_rank * share, (local_rank + 1) * share))
