"""Agents' events, as the job manager takes them in: a rank's exit or hang (only from the
node that hosts it in the current attempt, and once), a node lost (its verdict waiting,
when due, for its peers' beats: :mod:`coordinator.loss_verdict`), a hang no node can pin
(waiting for the network's word: :mod:`coordinator.hang_verdict`), a spot notice's risk.

An event changes one job's record and books at a time and returns what to say and do
(:data:`coordinator.job_effects.Outcome`), which the manager carries out before the next
job's turn; the decisions are the policy's. Its only I/O is the ping that asks which of a
job's nodes are gone when a rank fails (:meth:`coordinator.recovery.Stopper.unreachable`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from coordinator import actions, exclusion, hang_verdict, job_machine, policy
from coordinator.job_books import Books
from coordinator.job_effects import Outcome
from coordinator.loss_verdict import AwaitedVerdicts, evidence_at
from coordinator.network_culprit import suspects
from coordinator.reconcile import hosts_rank, peers_stepped_on
from coordinator.registry import Registry
from proto.conditions import Severity
from proto.events import EventBase, JobAtRisk, NodeAway, SpotNotice, WorkerExited, WorkerHung
from proto.job import JobRecord
from proto.node import NodeState
from ringmaster.clock import Clock

log = structlog.get_logger()
Unreachable = Callable[[JobRecord], Awaitable[frozenset[str]]]


class AgentEvents:
    def __init__(self, registry: Registry, unreachable: Unreachable, clock: Clock) -> None:
        self.registry, self.unreachable, self.clock = registry, unreachable, clock

    @staticmethod
    def on_nodes(event: EventBase) -> list[actions.Action]:
        """What the event's condition asks of its node, whatever its jobs."""
        return [] if event.condition is None else policy.on_node_condition(event.condition)

    async def take(
        self, job: JobRecord, books: Books, awaited: AwaitedVerdicts, event: EventBase
    ) -> list[Outcome]:
        """What one event, its ``node`` already checked against the subject it came on
        (the leader does that), means for ``job``. A rank's exit or hang is taken only
        from the node that hosts that rank in the job's current attempt, and only once."""
        said: list[Outcome] = []
        if isinstance(event, SpotNotice) and event.deadline and event.node:
            window_s = event.deadline.timestamp() - self.clock.time()
            said += _at_risk(job, event.node, window_s)
        if isinstance(event, WorkerExited | WorkerHung):
            if event.job != job.id or not speaks_for(job, event):
                return said
            self._record(job, books, event)
        if isinstance(event, NodeAway) and self._awaits_evidence(job, books, awaited, event):
            return said
        if isinstance(event, WorkerHung) and self._holds_for_network(job, books, event):
            return said
        return [*said, *await self.decide(job, books, event)]

    async def decide(self, job: JobRecord, books: Books, event: EventBase) -> list[actions.Action]:
        """The policy's verdict on ``event`` for ``job``, with the evidence it weighs: which
        nodes are gone, whether the ranks still step, the network's conditions."""
        silent: frozenset[str] = frozenset()
        if _failed_rank(job, event):
            # only a rank's failure asks which nodes are gone (see policy.decide)
            now = self.clock.monotonic()
            silent = self.registry.silent(job.nodes, now) | await self.unreachable(job)
        progressing = isinstance(event, NodeAway) and self._steps_there(job, books, event.node)
        judged = isinstance(event, WorkerHung) or _failed_rank(job, event)
        links = self.registry.link_conditions(job.nodes) if judged else {}
        return policy.decide(job, event, silent, progressing=progressing, links=links)

    def _awaits_evidence(
        self, job: JobRecord, books: Books, awaited: AwaitedVerdicts, event: NodeAway
    ) -> bool:
        """Whether the verdict on an away node of the live job waits for its peers' steps
        (:mod:`coordinator.loss_verdict`): the evidence that its ranks step on is due but
        not every other node of the job has beaten since."""
        node = self.registry.nodes.get(event.node or "")
        if node is None or node.id not in job.nodes or job.state not in job_machine.LIVE:
            return False
        due = evidence_at(books.stepped_at, job.step_s)
        if due is None or self.decidable(job, books, event, due):
            return False
        awaited.wait(job, event, due, self.clock.monotonic())
        log.info(
            "node silent; its verdict waits for its peers' next beat", job=job.id, node=node.id
        )
        return True

    def _holds_for_network(self, job: JobRecord, books: Books, event: WorkerHung) -> bool:
        """Whether a hang no node can pin waits for the network's word
        (:mod:`coordinator.hang_verdict`): none names a suspect yet, and the job's nodes'
        probes may still find one."""
        if not event.culprit_unknown or self.network_evidence(job):
            return False
        nodes = [self.registry.nodes.get(n) for n in job.nodes]
        wait = max((n.probe_confirm_s for n in nodes if n is not None), default=0.0)
        if wait <= 0:
            return False
        if hang_verdict.hold(job, event, self.clock.time() + wait + hang_verdict.SLACK_S):
            log.info("hang without a culprit; its verdict waits for the network", job=job.id)
            books.dirty = True
        return True

    def network_evidence(self, job: JobRecord) -> bool:
        return bool(suspects(job, self.registry.link_conditions(job.nodes)))

    def decidable(self, job: JobRecord, books: Books, event: NodeAway, due: float) -> bool:
        """The peers prove the ranks step on, or every other node of the job that still
        beats has beaten after ``due`` (so its beat would show those steps), or none does."""
        if self._steps_there(job, books, event.node):
            return True
        peers = [self.registry.nodes.get(n) for n in job.nodes if n != event.node]
        gone = (NodeState.LOST, NodeState.AWAY)
        beating = [p for p in peers if p is not None and p.state not in gone]
        return all(p.beat_seen >= due for p in beating)

    def still_away(self, event: NodeAway) -> bool:
        """The node a waiting verdict is about has not beaten again since."""
        node = self.registry.nodes.get(event.node or "")
        return node is not None and node.state is NodeState.AWAY

    def _record(self, job: JobRecord, books: Books, event: WorkerExited | WorkerHung) -> None:
        if isinstance(event, WorkerHung):
            if job.state in job_machine.LIVE:  # an attempt being given up already counted its hang
                exclusion.hung(job, event.node or "?", self.clock.time())
        else:
            code = event.exit_code if event.exit_code is not None else -(event.signal or 255)
            job.exited_ranks[str(event.rank)] = code
            attempt = books.attempt(job.attempt)
            if attempt.first_exit_at is None:
                attempt.first_exit_at = self.clock.monotonic()
        books.dirty = True

    def vouch_for_away_nodes(self, job: JobRecord, books: Books, now: float) -> None:
        """Every tick: an away node of a live job whose ranks still step is vouched for,
        so that its grace does not run out (:meth:`Registry.vouch`); one that no job
        vouches for is lost once it does."""
        if job.state not in job_machine.LIVE:
            return
        for node_id in job.nodes:
            node = self.registry.nodes.get(node_id)
            away = node is not None and node.state is NodeState.AWAY
            if away and self._steps_there(job, books, node_id):
                self.registry.vouch(node_id, now)

    def _steps_there(self, job: JobRecord, books: Books, node_id: str | None) -> bool:
        """For an away node: rank 0 reported a step after the node had already missed
        beats, or the ranks on the other nodes stepped on past rank 0's word (which comes
        through that very node when rank 0 is there: ``reconcile.peers_stepped_on``), so
        the job's ranks, that node's included, still step together."""
        node = self.registry.nodes.get(node_id or "")
        if node is None:
            return False
        overdue = node.beat_seen + 1.5 * node.interval_s
        if books.stepped_at is not None and books.stepped_at > overdue:
            return True
        return peers_stepped_on(job, self.registry.nodes, node.id)


def speaks_for(job: JobRecord, event: WorkerExited | WorkerHung) -> bool:
    """Only the node hosting a rank in the current attempt speaks for it, and an exit
    counts once (a repeated or a reconciled one is the same fact)."""
    if not hosts_rank(job, event.node or "", event.rank, event.attempt):
        return False
    return not (isinstance(event, WorkerExited) and str(event.rank) in job.exited_ranks)


def _failed_rank(job: JobRecord, event: EventBase) -> bool:
    return (
        isinstance(event, WorkerExited)
        and event.job == job.id
        and event.attempt == job.attempt
        and event.exit_code != 0
        and job.state in job_machine.LIVE
        and not job.stopping
    )


def _at_risk(job: JobRecord, node: str, window_s: float) -> list[Outcome]:
    """Said before the evacuation starts, so the on-call engineer knows what to expect."""
    why = policy.at_risk(job, node, window_s)
    if why is None:
        return []
    risk = JobAtRisk(
        job=job.id,
        node=node,
        severity=Severity.WARNING,
        window_s=window_s,
        checkpoint_s=job.checkpoint_s or 0.0,
        last_checkpoint_step=job.last_checkpoint_step,
        message=why,
    )
    return [risk]
