"""The node registry, fed by heartbeats and the events that carry conditions. Pure:
callers pass the time.

A node's conditions are a mirror of its agent's: each heartbeat carries the agent's whole
active set and replaces the mirror, and an event that opens or closes a condition updates
it at once, between beats. The agent is the one source of truth; the coordinator adds only
what it alone can know (a lost heartbeat, a judgement on a condition), and notes which
nodes changed (``touched``) for :mod:`coordinator.node_keeper`, which keeps their life.

A node condition at ``info`` severity is advisory: a warning the node runs with (a stock
kernel tunable, a clock called unsynchronised but measured in bounds). It is mirrored and
shown like any other, but leaves the node ready and eligible; only the others degrade it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from coordinator.node_info import NodeInfo
from proto.conditions import LINK_KINDS, Condition, ConditionKind
from proto.node import Heartbeat, NodeBeat, NodeState

NETWORK_KINDS = LINK_KINDS | {ConditionKind.NET_PEER}  # what a hang's culprit is judged by


# s: an away node is declared lost after this long silent with no job showing its ranks
# there still stepping. It covers an agent restarted by its supervisor (systemd's restart,
# an upgrade: seconds) so that it is no page; a job's node is judged sooner, by its
# peers' steps (:meth:`Registry.declare_lost`).
AWAY_GRACE_S = 15.0


class Registry:
    """``bus_outage_s``: how long the coordinator's own canary may stay away before the
    bus counts as out (see :meth:`bus_alive`). ``away_grace_s``: :data:`AWAY_GRACE_S`."""

    def __init__(
        self, missed_beats: int = 3, bus_outage_s: float = 1.5, away_grace_s: float = AWAY_GRACE_S
    ) -> None:
        # least recently heard first (each beat moves its node to the end): a sweep reads
        # only the silent front
        self.nodes: OrderedDict[str, NodeInfo] = OrderedDict()
        self.missed_beats = missed_beats
        self.bus_outage_s = bus_outage_s
        self.away_grace_s = away_grace_s
        self._declared: list[NodeInfo] = []  # lost on a job's verdict since the last sweep
        self.ranked: set[str] = set()  # the nodes whose newest beat lists ranks
        self._shortest_interval = math.inf  # of any node's heartbeat interval
        self._bus_seen: float | None = None  # None: no canary wired, the bus is assumed up
        # nodes whose conditions or silence changed since the node keeper last looked
        self.touched: set[str] = set()
        # gives a node first heard its recorded life before anything can place work there
        self.on_new: Callable[[NodeInfo], None] | None = None

    def bus_alive(self, now: float) -> None:
        """The coordinator's canary came back through the server. After an outage every
        node gets a fresh window: none of them could have beaten while the bus was out."""
        if self._bus_seen is not None and now - self._bus_seen > self.bus_outage_s:
            for node in self.nodes.values():
                node.last_seen = max(node.last_seen, now)
        self._bus_seen = now

    def bus_out(self, now: float) -> bool:
        return self._bus_seen is not None and now - self._bus_seen > self.bus_outage_s

    def observe(self, beat: NodeBeat | Heartbeat, now: float) -> tuple[NodeInfo, bool]:
        """Record a heartbeat. Returns the node and whether it is new or back from lost.
        Its conditions are mirrored anew only when they differ from the previous beat's
        (or an event changed the mirror since): most beats repeat the last one's."""
        node = self.nodes.get(beat.node)
        fresh = node is None or node.state is NodeState.LOST
        if node is None:
            node = self.nodes[beat.node] = NodeInfo(id=beat.node)
            if self.on_new is not None:
                self.on_new(node)
        if fresh:
            self.touched.add(beat.node)
        node.addr, node.hostname, node.gpus = beat.addr, beat.hostname, beat.gpus
        node.cpus = beat.cpus
        node.simulated, node.interval_s = beat.simulated, beat.interval_s
        node.jobs, node.last_seen = beat.jobs, now
        # a raw field is a view of the whole beat it came in: held, a copy of itself alone
        telemetry = beat.telemetry
        node._telemetry = telemetry.copy() if isinstance(telemetry, msgspec.Raw) else telemetry
        node.beat_seen = now
        self.nodes.move_to_end(beat.node)
        self._shortest_interval = min(self._shortest_interval, beat.interval_s)
        node.beat_sent_at, node.metrics_url = beat.sent_at, beat.metrics_url
        node.ranks, node.agent_started_at = beat.ranks, beat.started_at
        node.launched = beat.launched
        key = tuple(
            (r.job, r.rank, r.attempt, r.pid, r.alive, r.exit_code, r.signal) for r in beat.ranks
        )
        if key != node._ranks_key:
            node._ranks_key, node.ranks_version = key, node.ranks_version + 1
            (self.ranked.add if key else self.ranked.discard)(beat.node)
        node.probe_port, node.probe_confirm_s = beat.probe_port, beat.probe_confirm_s
        if node._news or beat.conditions != node._beat_conditions:
            node.conditions = self._mirror(node, beat)
            node._beat_conditions = None if node._news else beat.conditions
            self._changed(node)
        if node.suspect_at is not None and now > node.suspect_at:
            node.suspect_at = None  # it answers after all
        if node.state in (NodeState.LOST, NodeState.AWAY):
            node.state = NodeState.READY
            self.touched.add(beat.node)
        node.settle()
        return node, fresh

    @staticmethod
    def _mirror(node: NodeInfo, beat: NodeBeat | Heartbeat) -> dict[str, Condition]:
        mirror = {c.key: c for c in beat.conditions if c.active}
        # An event may have overtaken the beat (they travel separately): its change stands
        # until a beat sent after it says otherwise.
        for key, news in list(node._news.items()):
            if news.since <= beat.sent_at:
                del node._news[key]
            elif news.active:
                mirror[key] = news
            else:
                mirror.pop(key, None)
        return mirror

    def observe_condition(self, cond: Condition) -> None:
        """An event opened or closed ``cond`` on its node: mirror it now."""
        node = self.nodes.get(cond.node)
        if node is None:
            return
        if cond.since > node.beat_sent_at:
            node._news[cond.key] = cond
        node._beat_conditions = None  # the mirror is no longer the beat's alone
        if cond.active:
            node.conditions[cond.key] = cond
        else:
            node.conditions.pop(cond.key, None)
        self._changed(node)
        node.settle()

    def _changed(self, node: NodeInfo) -> None:
        """Its conditions changed: a judgement on one that closed goes with it."""
        if node.judged:
            node.judged = {k: v for k, v in node.judged.items() if k in node.conditions}
        self.touched.add(node.id)

    def active(self, nodes: list[str]) -> dict[str, Condition]:
        """Every open condition on ``nodes``, by key."""
        return {
            key: cond
            for node_id in nodes
            if (node := self.nodes.get(node_id)) is not None
            for key, cond in node.conditions.items()
        }

    def sweep(self, now: float) -> tuple[list[NodeInfo], list[NodeInfo]]:
        """Nodes newly away (``missed_beats`` intervals of silence) and newly lost (away
        past ``away_grace_s`` since its last beat or its last :meth:`vouch`; or declared
        lost since). While the bus itself is out, silence is no evidence: nobody is
        marked."""
        lost, self._declared = self._declared, []
        if self.bus_out(now):
            return [], lost
        away = []
        # Least recently heard first: once a node has been heard within the shortest
        # interval's allowance, every node after it has been too (each heard later).
        soon = self.missed_beats * self._shortest_interval
        for node in self.nodes.values():
            silent = now - node.last_seen
            if silent <= soon:
                break
            if node.state is NodeState.LOST or silent <= self.missed_beats * node.interval_s:
                continue
            if node.state is not NodeState.AWAY:
                node.state = NodeState.AWAY
                away.append(node)
            if now - max(node.last_seen, node.vouched_at) > self.away_grace_s:
                node.state, node.lost_reason = NodeState.LOST, "no job's ranks step there"
                lost.append(node)
                self.touched.add(node.id)
        return away, lost

    def vouch(self, node_id: str, now: float) -> None:
        """A job shows the away node's ranks still stepping: its grace starts again."""
        node = self.nodes.get(node_id)
        if node is not None and node.state is NodeState.AWAY:
            node.vouched_at = now

    def declare_lost(self, node_id: str, reason: str) -> NodeInfo | None:
        """An away node's job found its ranks stopped (``reason``): lost now, and among
        the next sweep's lost. The node, when this changed it (None when it is not away:
        beating again, or lost already)."""
        node = self.nodes.get(node_id)
        if node is None or node.state is not NodeState.AWAY:
            return None
        node.state, node.lost_reason = NodeState.LOST, reason
        self._declared.append(node)
        self.touched.add(node_id)
        return node

    def silent(self, nodes: list[str], now: float, beats: float = 1.5) -> frozenset[str]:
        """Those of ``nodes`` whose agent has been quiet for ``beats`` intervals (not yet
        lost, but no longer to be counted on); nobody while the bus is out."""
        if self.bus_out(now):
            return frozenset()
        return frozenset(
            node_id
            for node_id in nodes
            if (node := self.nodes.get(node_id)) is None
            or node.state in (NodeState.LOST, NodeState.AWAY)
            or node.suspect_at is not None
            or now - node.last_seen > beats * node.interval_s
        )

    def link_conditions(self, nodes: list[str]) -> dict[str, list[Condition]]:
        """The open network conditions (links, and the peers each cannot reach) of those
        of ``nodes`` that have any, as their agents last reported them."""
        found = {}
        for node_id in nodes:
            node = self.nodes.get(node_id)
            conds = [c for c in node.conditions.values() if c.kind in NETWORK_KINDS] if node else []
            if conds:
                found[node_id] = conds
        return found

    def suspect(self, node_id: str, now: float) -> None:
        """Its agent did not answer: not admitted until its next heartbeat."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.suspect_at = now

    def drain(self, node_id: str, key: str, reason: str) -> None:
        """The coordinator judged the open condition ``key`` reason enough to drain the
        node (``reason``, the evidence): a cause of its drain while that condition stays
        open (:mod:`coordinator.node_life`). Nothing for a condition no longer open."""
        node = self.nodes.get(node_id)
        if node is not None and key in node.conditions:
            node.judged[key] = reason
            self.touched.add(node_id)

    def hold(self, node_id: str, evidence: str) -> None:
        """The coordinator's verdict on what the node computes (``evidence``): held for a
        person at the node keeper's next look (:func:`coordinator.node_verbs.hold`)."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.hold_for = evidence
            self.touched.add(node_id)
