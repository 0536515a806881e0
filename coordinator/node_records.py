"""Node records in KV (``status`` reads them): what the leader knows of each node, written
when what an operator sees changes and otherwise refreshed at most every
:data:`NODE_REFRESH_S`, spread over the passes."""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from coordinator.node_info import NodeInfo
from coordinator.registry import Registry
from proto.codec import encode
from proto.node import NodeRecord
from ringmaster.clock import Clock

log = structlog.get_logger()
NODE_REFRESH_S = 15.0  # telemetry in node records is at most this old
WRITES_IN_FLIGHT = 32  # bounded, so lease renewals and commands never queue behind them
YIELD_EVERY = 500  # nodes examined between yields to the event loop


class Put(Protocol):
    async def put(self, key: str, value: bytes) -> int: ...


class NodeRecords:
    """The leader's writer of node records into the ``nodes`` bucket (``kv``)."""

    def __init__(self, registry: Registry, kv: Put, clock: Clock) -> None:
        self.registry, self.kv, self.clock = registry, kv, clock
        self.written: dict[str, tuple[object, float]] = {}  # each node's key, written when

    async def write(self) -> None:
        """Node records go to KV when what an operator sees changes (state, conditions,
        jobs, drain, cordon, Slurm's drain) and otherwise at most every ``NODE_REFRESH_S``:
        telemetry changes every beat, and 10,000 nodes must not mean 10,000 KV writes a
        second."""
        wall, mono = self.clock.time(), self.clock.monotonic()
        changed, stale = [], []
        for i, node in enumerate(list(self.registry.nodes.values())):  # beats add nodes
            if i and i % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let events through: a decision must not wait for us
            conditions = node.conditions
            key = (
                node.state,
                tuple((k, c.severity) for k, c in conditions.items()) if conditions else (),
                node.jobs,
                node.drain_reason,
                node.cordoned_by,
                node.slurm_drain,
                node.metrics_url,
            )
            written = self.written.get(node.id)
            if written is None or written[0] != key:
                changed.append((node, key))
            elif mono - written[1] >= NODE_REFRESH_S:
                stale.append((written[1], node, key))
        # Refreshes are spread evenly (a share of the nodes each pass, oldest first) rather
        # than arriving as one burst every NODE_REFRESH_S; changes always go at once.
        budget = max(1, len(self.registry.nodes) // int(NODE_REFRESH_S))
        stale.sort(key=lambda item: item[0])
        due = changed + [(node, key) for _, node, key in stale[:budget]]
        pending = iter(due)

        async def writer() -> None:
            # A few writers draining one iterator, not a task per record: after a takeover
            # every one of 10,000 nodes is new, and 10,000 tasks created in one go stall
            # the event loop for longer than a decision may take.
            for node, key in pending:
                record = _record(node, wall, mono)
                if node.telemetry_error:  # the record goes without it: the node still beats
                    log.warning("node telemetry not read", node=node.id, error=node.telemetry_error)
                try:
                    await self.kv.put(node.id, encode(record))
                except Exception as exc:
                    log.warning("node record not written", node=node.id, error=repr(exc))
                    continue
                self.written[node.id] = (key, mono)

        await asyncio.gather(*(writer() for _ in range(min(WRITES_IN_FLIGHT, len(due)))))


def _record(node: NodeInfo, wall: float, mono: float) -> NodeRecord:
    return NodeRecord(
        id=node.id,
        state=node.state,
        addr=node.addr,
        hostname=node.hostname,
        gpus=node.gpus,
        simulated=node.simulated,
        last_seen=round(wall - (mono - node.last_seen), 1),
        telemetry=node.telemetry,
        conditions=sorted(node.conditions.values(), key=lambda c: c.key),
        jobs=list(node.jobs),
        drain_reason=node.drain_reason,
        drained_by=node.drained_by,
        cordoned_by=node.cordoned_by,
        held=node.held,
        probation_until=node.probation_until,
        slurm_drain=node.slurm_drain,
        preflight_ok=node.preflight_ok,
        topology_ok=node.topology_ok,
        metrics_url=node.metrics_url,
    )
