"""Ringmaster's drains in Slurm, set and lifted exactly with its own.

Level-triggered, from each node's life (:mod:`coordinator.node_life`: its critical
conditions, its loss, an operator's drain, the probation after them, a hold) and Slurm's
own view (``sinfo``), each pass: a node Ringmaster drains is drained in Slurm with
``Reason="ringmaster: <key>: <evidence>"`` (``ringmaster: operator: <reason>`` for an
operator's drain), so the scheduler stops placing work there; once Ringmaster returns it
to service, a drain whose reason still starts with ``ringmaster:`` is lifted. A drain an
administrator set (any other reason) is never touched, only shown beside the node
(``NodeInfo.slurm_drain``), and a node that is silent now (away) is left as it is:
nothing it could say is known.

A drain fires once per fault: if someone lifts it while the same condition stays open,
it is not set again (the scheduler's operator had the last word). Nodes are matched to
Slurm's names by node id, else by short hostname.

:func:`plan` is the decision, pure; :class:`SlurmDrains` the thin shell that runs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import structlog

from coordinator.registry import NodeInfo
from proto.conditions import Severity
from proto.events import EventBase, NodeSlurm
from proto.node import NodeState
from ringmaster import slurm
from ringmaster.slurm import PREFIX, SlurmError, SlurmNode

log = structlog.get_logger()
REASON_MAX = 200  # characters of evidence in a reason: sinfo -R shows one line
POLL_S = 5.0  # how often Slurm's view is read and compared


@dataclass(frozen=True)
class Drain:
    node: str  # Slurm's name
    key: str  # what it is drained for: a condition key, or "node.lost"
    reason: str


@dataclass(frozen=True)
class Lift:
    node: str
    reason: str  # ours, as Slurm held it


def cause(node: NodeInfo) -> tuple[str, str] | None:
    """Why Ringmaster drains ``node``, as (key, evidence); None while it serves."""
    return node.slurm_cause


def slurm_name(node: NodeInfo, known: Mapping[str, SlurmNode]) -> str | None:
    if node.id in known:
        return node.id
    short = node.hostname.split(".")[0]
    return short if short in known else None


def plan(
    nodes: Iterable[NodeInfo], known: Mapping[str, SlurmNode], drained_for: Mapping[str, str]
) -> list[Drain | Lift]:
    """What to change in Slurm. ``drained_for``: the key each node was drained for by
    us, while that fault stands (a drain is set once per fault)."""
    changes: list[Drain | Lift] = []
    for node in nodes:
        name = slurm_name(node, known)
        if name is None or node.state is NodeState.AWAY:
            continue
        there = known[name]
        why = cause(node)
        if why is not None:
            key, evidence = why
            if not there.drained and drained_for.get(name) != key:
                changes.append(Drain(name, key, f"{PREFIX} {key}: {evidence}"[:REASON_MAX]))
        elif there.drained and there.ours:
            changes.append(Lift(name, there.reason))
    return changes


class SlurmDrains:
    """Runs :func:`plan` against Slurm every :data:`POLL_S` (the leader's duty)."""

    def __init__(
        self,
        nodes: Callable[[], Iterable[NodeInfo]],
        publish: Callable[[EventBase], Awaitable[None]],
    ) -> None:
        self.nodes, self.publish = nodes, publish
        self.drained_for: dict[str, str] = {}
        self._warned: set[str] = set()  # failures already reported, until they work

    async def reconcile(self) -> None:
        try:
            known = await asyncio.to_thread(slurm.nodes)
        except SlurmError as exc:
            await self._failed("sinfo", None, str(exc))
            return
        self._warned.discard("sinfo")
        current = list(self.nodes())
        for node in current:  # a fault closed: a new one drains again
            name = slurm_name(node, known)
            there = known.get(name) if name is not None else None
            node.slurm_drain = there.reason if there and there.drained and not there.ours else ""
            if name in self.drained_for and node.state is not NodeState.AWAY and not cause(node):
                del self.drained_for[name]
        for change in plan(current, known, self.drained_for):
            await self._apply(change)

    async def _apply(self, change: Drain | Lift) -> None:
        try:
            if isinstance(change, Drain):
                await asyncio.to_thread(slurm.drain, change.node, change.reason)
            else:
                await asyncio.to_thread(slurm.lift, change.node)
        except SlurmError as exc:
            await self._failed(f"{type(change).__name__}:{change.node}", change.node, str(exc))
            return
        self._warned.discard(f"{type(change).__name__}:{change.node}")
        if isinstance(change, Drain):
            self.drained_for[change.node] = change.key
            said = f"drained in Slurm: {change.reason}"
            event = NodeSlurm(
                node=change.node, severity=Severity.WARNING, action="drained", message=said
            )
        else:
            said = f"drain lifted in Slurm (was {change.reason!r}): Ringmaster returned it"
            event = NodeSlurm(node=change.node, action="resumed", message=said)
        event.reason = change.reason
        log.info("slurm", node=change.node, action=event.action, reason=change.reason)
        await self.publish(event)

    async def _failed(self, what: str, node: str | None, error: str) -> None:
        """A warning once per failure that persists (retried every pass)."""
        log.warning("slurm command failed; will retry", what=what, error=error)
        if what in self._warned:
            return
        self._warned.add(what)
        await self.publish(
            NodeSlurm(
                node=node,
                severity=Severity.WARNING,
                action="failed",
                reason=error,
                message=f"Slurm not updated, retrying every {POLL_S:g} s: {error}",
            )
        )
