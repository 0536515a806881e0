"""The leader's keeper of node lives: the I/O around :mod:`coordinator.node_life`.

Each tick it gives the decision what the registry knows of every node that changed (its
agent's conditions, its silence, the coordinator's judgements) and of every node on
probation, and carries the steps out in order: the record is saved first (fenced: a
deposed leader's step stops there), then the node's view in the registry (which
admission, the node records and Slurm's drains read), then the events, then an operator
drain's evacuation. The operator's ``cordon``/``drain``/``undrain`` come in through
:meth:`control`. A new leader loads every record and looks at every node: the same
evidence takes no step, so nothing right is changed or said twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import structlog

from coordinator import node_life, node_verbs, node_view
from coordinator.cas import CasStore, Conflict
from coordinator.life_store import LifeStore
from coordinator.node_info import NodeInfo
from coordinator.node_life import Cause, Effect, Evidence, Input, Step
from coordinator.registry import Registry
from proto.api import ApiReply, NodeControl
from proto.conditions import ConditionKind, Severity
from proto.events import EventBase, NodeCordoned, NodeDrained, NodeReturned
from proto.node import NodeState
from proto.node_life import Fault, NodeLife, Phase
from ringmaster.clock import Clock

log = structlog.get_logger()
Publish = Callable[[EventBase], Awaitable[None]]
Evacuate = Callable[[str, str], Awaitable[None]]  # node, why
YIELD_EVERY = 500  # nodes looked at between yields to the event loop


def evidence(node: NodeInfo) -> Evidence:
    """What the node's agent and the coordinator say of it now: its critical conditions,
    the coordinator's judgements on open ones, its loss; and its health gate (its open
    warning or critical conditions, as ``nodeagent --health-gate`` reads them)."""
    if node.state is NodeState.AWAY:
        return Evidence(known=False)
    causes = [
        Cause(c.key, c.kind.value, c.reason or c.kind.value)
        for c in sorted(node.conditions.values(), key=lambda c: c.key)
        if c.severity is Severity.CRITICAL
    ]
    named = {c.key for c in causes}
    for key, why in sorted(node.judged.items()):
        if key not in named and (cond := node.conditions.get(key)) is not None:
            causes.append(Cause(key, cond.kind.value, why))
    if node.state is NodeState.LOST:
        causes.append(Cause(node_life.LOST, node_life.LOST, node.lost_reason or "no heartbeat"))
    gate = "; ".join(c.reason or c.key for c in node.faults())
    return Evidence(causes=tuple(causes), gate=gate)


class NodeKeeper:
    def __init__(
        self,
        registry: Registry,
        cas: CasStore,
        publish: Publish,
        evacuate: Evacuate,
        clock: Clock,
        probation: Mapping[str, float] = node_life.PROBATION_S,
    ) -> None:
        self.registry, self.store, self.publish = registry, LifeStore(cas), publish
        self.evacuate, self.clock, self.probation = evacuate, clock, probation
        self.lives: dict[str, NodeLife] = {}
        self._watched: set[str] = set()  # on probation: looked at every tick
        self._lock = asyncio.Lock()  # one change of a node's life at a time

    async def load(self) -> None:
        """Take over every record; every node known is looked at on the next tick, and one
        heard for the first time gets its record's view before it can take work."""
        self.lives = await self.store.load()
        self._watched = {n for n, life in self.lives.items() if life.phase is Phase.PROBATION}
        now = self.clock.time()
        for node in self.registry.nodes.values():
            self._show(node, self.lives.get(node.id), now)
        self.registry.touched.update(self.registry.nodes)
        self.registry.on_new = lambda node: self._show(node, self.lives.get(node.id), now)

    def stop(self) -> None:
        self.registry.on_new = None

    async def tick(self) -> None:
        ids, self.registry.touched = self.registry.touched | self._watched, set()
        async with self._lock:
            now = self.clock.time()
            for i, node_id in enumerate(sorted(ids)):
                if i and i % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # after a takeover every node is looked at
                node = self.registry.nodes.get(node_id)
                if node is not None:
                    await self._step(node, now)

    async def _step(self, node: NodeInfo, now: float) -> NodeLife | None:
        """The node's record brought up to what is known of it now; None when another
        leader has written it since."""
        ev, verdict = evidence(node), node.hold_for
        life = self.lives.get(node.id)
        if life is None and not ev.causes and not verdict:
            return NodeLife(node=node.id, since=now)  # serving, and nothing to change that
        life = life or NodeLife(node=node.id, since=now)
        new, steps = node_life.step(life, ev, now, self.probation)
        if verdict:
            new, held = node_verbs.hold(new, verdict, now)
            steps += held
        if not await self._carry(node.id, new, steps, now):
            return None
        if node.hold_for == verdict:
            node.hold_for = ""  # taken: on record, said once
        return new

    async def control(self, req: NodeControl) -> ApiReply:
        """An operator's ``cordon``, ``drain`` or ``undrain``: refused (``ok`` false) for
        a node nobody knows, a drain without a reason, or an undrain that cannot return
        the node (a condition still open); the reply's note says what else holds."""
        if req.action == "drain" and not req.reason.strip():
            return ApiReply(ok=False, error="drain needs a reason (--reason TEXT)")
        node = self.registry.nodes.get(req.node)
        if node is None and req.node not in self.lives:
            return ApiReply(ok=False, error=f"no node {req.node!r}")
        async with self._lock:
            now = self.clock.time()
            life: NodeLife | None = self.lives.get(req.node) or NodeLife(node=req.node, since=now)
            if node is not None:
                life = await self._step(node, now)
            if life is None:
                return ApiReply(ok=False, error="another coordinator leads now; try again")
            new, steps, note = node_verbs.command(life, req.action, req.by, req.reason, now)
            if not await self._carry(req.node, new, steps, now):
                return ApiReply(ok=False, error="another coordinator leads now; try again")
        if req.action == "undrain" and new.phase is not Phase.SERVING:
            return ApiReply(ok=False, error=f"{req.node}: {note}")
        return ApiReply(ok=True, note=note)

    async def _carry(self, node_id: str, life: NodeLife, steps: list[Step], now: float) -> bool:
        """Save, show, tell, evacuate, in that order; False when the save lost (another
        leader's record is taken instead and nothing is said or done)."""
        if any(Effect.SAVE in s.effects for s in steps):
            try:
                await self.store.save(life)
            except Conflict:
                log.warning("node life changed under us: another leader wrote it", node=node_id)
                found = await self.store.read(node_id)
                if found is not None:
                    self.lives[node_id] = found
                return False
        self.lives[node_id] = life
        (self._watched.add if life.phase is Phase.PROBATION else self._watched.discard)(node_id)
        if (node := self.registry.nodes.get(node_id)) is not None:
            self._show(node, life, now)
        for s in steps:
            log.info("node life", node=node_id, input=s.input.value, phase=s.after.value)
            for effect in s.effects:
                await self._effect(node_id, life, s, effect)
        return True

    @staticmethod
    def _show(node: NodeInfo, life: NodeLife | None, now: float) -> None:
        """The node's view of its life, which admission, records and Slurm read."""
        life = life or NodeLife(node=node.id)
        node.drain_reason = node_view.drain_reason(life, now)
        serving = life.phase is Phase.SERVING
        node.drained_by = "" if serving else life.drain.by if life.drain else "ringmaster"
        node.cordoned_by = life.cordon.by if life.cordon else ""
        node.held = life.phase is Phase.HELD
        node.probation_until = node_view.probation_until(life)
        node.serving_since = life.since if serving else None
        node.slurm_cause = node_view.slurm_cause(life)
        node.settle()

    async def _effect(self, node: str, life: NodeLife, s: Step, effect: Effect) -> None:
        fault, by = s.fault, s.by or "ringmaster"
        event: EventBase
        match effect:
            case Effect.DRAINED if s.input is Input.DRAIN and life.drain is not None:
                why = life.drain.reason
                event = NodeDrained(cause=node_life.OPERATOR, evidence=why, by=by)
                await self._publish(event, node, f"drained by {by}: {why}")
            case Effect.DRAINED | Effect.HELD if fault is not None:
                said = f"drained for {fault.key}: {fault.evidence}"
                event = NodeDrained(cause=fault.key, evidence=fault.evidence, by=by)
                if effect is Effect.HELD:
                    event.held, event.history, event.severity = True, life.held, Severity.CRITICAL
                    said = f"held for a person: {life.held}; undrain it to return it"
                await self._publish(event, node, said)
            case Effect.RETURNED if s.input is Input.SERVED and fault is not None:
                ended = "closed"
                if fault.kind == ConditionKind.PREEMPTION and not _lost_since(life, fault):
                    ended = "passed with the node still up"  # the notice was not carried out
                evidence = (
                    f"{fault.key} {ended} ({fault.evidence}); its health gate passed for "
                    f"{s.probation_s:g} s"
                )
                event = NodeReturned(
                    cause=fault.key, evidence=evidence, probation_s=s.probation_s, by=by
                )
                await self._publish(event, node, f"back in service: {evidence}")
            case Effect.RETURNED:
                said = f"undrained by {by}"
                event = NodeReturned(cause=node_life.OPERATOR, evidence=said, by=by)
                await self._publish(event, node, f"back in service: {said}")
            case Effect.CORDONED:
                on = s.input is Input.CORDON
                reason = life.cordon.reason if on and life.cordon else ""
                said = (f"cordoned by {by}" if on else f"cordon lifted by {by}") + (
                    f": {reason}" if reason else ""
                )
                await self._publish(NodeCordoned(cordoned=on, by=by, reason=reason), node, said)
            case Effect.EVACUATE if life.drain is not None:
                await self.evacuate(node, f"drained by {life.drain.by}: {life.drain.reason}")

    async def _publish(self, event: EventBase, node: str, message: str) -> None:
        event.node, event.message = node, message
        if isinstance(event, NodeDrained) and event.severity is Severity.INFO:
            event.severity = Severity.WARNING  # no new work there: worth a look
        try:
            await self.publish(event)
        except Exception as exc:  # saved and shown already: the event is the lesser part
            log.warning("node life event not published", node=node, error=repr(exc))


def _lost_since(life: NodeLife, fault: Fault) -> bool:
    """Whether the node was lost after ``fault`` opened (a notice carried out)."""
    return any(f.kind == node_life.LOST and f.opened_at >= fault.opened_at for f in life.faults)
