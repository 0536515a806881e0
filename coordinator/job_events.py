"""Agents' events, as the job manager takes them in: a rank's exit or hang (only from the
node that hosts it in the current attempt, and once), a node lost (its verdict waiting,
when due, for its peers' beats: :mod:`coordinator.loss_verdict`), a hang no node can pin
(waiting for the network's word: :mod:`coordinator.hang_verdict`), a spot notice's risk.
A base of :class:`coordinator.jobs.JobManager`, apart only to keep each module small; the
decisions are the policy's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from coordinator import actions, hang_verdict, job_machine, policy
from coordinator.job_table import JobTable
from coordinator.loss_verdict import evidence_at
from coordinator.network_culprit import suspects
from coordinator.reconcile import hosts_rank, peers_stepped_on
from coordinator.recovery import Stopper
from coordinator.registry import Registry
from proto.conditions import Severity
from proto.events import EventBase, JobAtRisk, NodeAway, SpotNotice, WorkerExited, WorkerHung
from proto.job import JobRecord
from proto.node import NodeState
from ringmaster.clock import Clock

log = structlog.get_logger()


class EventInputs:
    jobs: dict[str, JobRecord]
    publish: Callable[[EventBase], Awaitable[None]]
    registry: Registry
    stopper: Stopper
    clock: Clock
    table: JobTable

    async def apply(self, job: JobRecord | None, action: actions.Action) -> None:
        raise NotImplementedError

    async def on_event(self, event: EventBase) -> None:
        """One event, its ``node`` already checked against the subject it came on (the
        leader does that): a rank's exit or hang is taken only from the node that hosts
        that rank in the job's current attempt, and only once."""
        if event.condition is not None:
            for action in policy.on_node_condition(event.condition):
                await self.apply(None, action)
        for job in list(self.jobs.values()):
            if isinstance(event, SpotNotice) and event.deadline and event.node:
                await self._warn_at_risk(
                    job, event.node, event.deadline.timestamp() - self.clock.time()
                )
            if isinstance(event, WorkerExited | WorkerHung) and event.job == job.id:
                if not speaks_for(job, event):
                    continue
                self._record(job, event)
            elif isinstance(event, WorkerExited | WorkerHung):
                continue  # another job's rank: nothing to do with this one
            if isinstance(event, NodeAway) and self._awaits_evidence(job, event):
                continue
            if isinstance(event, WorkerHung) and self._holds_for_network(job, event):
                continue
            await self._decide(job, event)

    async def _decide(self, job: JobRecord, event: EventBase) -> None:
        silent: frozenset[str] = frozenset()
        if self._failed_rank(job, event):
            # only a rank's failure asks which nodes are gone (see policy.decide)
            now = self.clock.monotonic()
            silent = self.registry.silent(job.nodes, now) | await self.stopper.unreachable(job)
        progressing = self._stepped_since_silent(job, event)
        judged = isinstance(event, WorkerHung) or self._failed_rank(job, event)
        links = self.registry.link_conditions(job.nodes) if judged else {}
        decided = policy.decide(job, event, silent, progressing=progressing, links=links)
        for action in decided:
            await self.apply(job, action)

    def _awaits_evidence(self, job: JobRecord, event: NodeAway) -> bool:
        """Whether the verdict on an away node of the live job waits for its peers' steps
        (:mod:`coordinator.loss_verdict`): the evidence that its ranks step on is due but
        not every other node of the job has beaten since."""
        node = self.registry.nodes.get(event.node or "")
        if node is None or node.id not in job.nodes or job.state not in job_machine.LIVE:
            return False
        due = evidence_at(self.table.books(job.id).stepped_at, job.step_s)
        if due is None or self._decidable(job, event, due):
            return False
        self.table.awaited.wait(job, event, due, self.clock.monotonic())
        log.info(
            "node silent; its verdict waits for its peers' next beat", job=job.id, node=node.id
        )
        return True

    def _holds_for_network(self, job: JobRecord, event: WorkerHung) -> bool:
        """Whether a hang no node can pin waits for the network's word
        (:mod:`coordinator.hang_verdict`): none names a suspect yet, and the job's nodes'
        probes may still find one."""
        if not event.culprit_unknown or self._network_evidence(job):
            return False
        nodes = [self.registry.nodes.get(n) for n in job.nodes]
        wait = max((n.probe_confirm_s for n in nodes if n is not None), default=0.0)
        if wait <= 0:
            return False
        if hang_verdict.hold(job, event, self.clock.time() + wait + hang_verdict.SLACK_S):
            log.info("hang without a culprit; its verdict waits for the network", job=job.id)
            self.table.changed(job)
        return True

    def _network_evidence(self, job: JobRecord) -> bool:
        return bool(suspects(job, self.registry.link_conditions(job.nodes)))

    def _decidable(self, job: JobRecord, event: NodeAway, due: float) -> bool:
        """The peers prove the ranks step on, or every other node of the job that still
        beats has beaten after ``due`` (so its beat would show those steps), or none does."""
        if self._stepped_since_silent(job, event):
            return True
        peers = [self.registry.nodes.get(n) for n in job.nodes if n != event.node]
        gone = (NodeState.LOST, NodeState.AWAY)
        beating = [p for p in peers if p is not None and p.state not in gone]
        return all(p.beat_seen >= due for p in beating)

    async def _warn_at_risk(self, job: JobRecord, node: str, window_s: float) -> None:
        """Said before the evacuation starts, so the on-call engineer knows what to expect."""
        if (why := policy.at_risk(job, node, window_s)) is not None:
            await self.publish(
                JobAtRisk(
                    job=job.id,
                    node=node,
                    severity=Severity.WARNING,
                    window_s=window_s,
                    checkpoint_s=job.checkpoint_s or 0.0,
                    last_checkpoint_step=job.last_checkpoint_step,
                    message=why,
                )
            )

    def _record(self, job: JobRecord, event: WorkerExited | WorkerHung) -> None:
        if isinstance(event, WorkerHung):
            node = event.node or "?"
            job.hangs[node] = job.hangs.get(node, 0) + 1
        else:
            code = event.exit_code if event.exit_code is not None else -(event.signal or 255)
            job.exited_ranks[str(event.rank)] = code
            books = self.table.books(job.id).attempt(job.attempt)
            if books.first_exit_at is None:
                books.first_exit_at = self.clock.monotonic()
        self.table.changed(job)

    @staticmethod
    def _failed_rank(job: JobRecord, event: EventBase) -> bool:
        return (
            isinstance(event, WorkerExited)
            and event.job == job.id
            and event.attempt == job.attempt
            and event.exit_code != 0
            and job.state in job_machine.LIVE
            and not job.stopping
        )

    def _stepped_since_silent(self, job: JobRecord, event: EventBase) -> bool:
        """For an away node: rank 0 reported a step after the node had already
        missed beats, or the ranks on the other nodes stepped on past rank 0's word (which
        comes through that very node when rank 0 is there: ``reconcile.peers_stepped_on``),
        so the job's ranks, that node's included, still step together."""
        if not isinstance(event, NodeAway):
            return False
        return self._steps_there(job, event.node or "")

    def vouch_for_away_nodes(self) -> None:
        """Every tick: an away node of a live job whose ranks still step is vouched for,
        so that its grace does not run out (:meth:`Registry.vouch`); one that no job
        vouches for is lost once it does."""
        now = self.clock.monotonic()
        for job in self.jobs.values():
            if job.state not in job_machine.LIVE:
                continue
            for node_id in job.nodes:
                node = self.registry.nodes.get(node_id)
                away = node is not None and node.state is NodeState.AWAY
                if away and self._steps_there(job, node_id):
                    self.registry.vouch(node_id, now)

    def _steps_there(self, job: JobRecord, node_id: str) -> bool:
        node = self.registry.nodes.get(node_id)
        if node is None:
            return False
        overdue = node.beat_seen + 1.5 * node.interval_s
        stepped_at = self.table.books(job.id).stepped_at
        if stepped_at is not None and stepped_at > overdue:
            return True
        return peers_stepped_on(job, self.registry.nodes, node.id)


def speaks_for(job: JobRecord, event: WorkerExited | WorkerHung) -> bool:
    """Only the node hosting a rank in the current attempt speaks for it, and an exit
    counts once (a repeated or a reconciled one is the same fact)."""
    if not hosts_rank(job, event.node or "", event.rank, event.attempt):
        return False
    return not (isinstance(event, WorkerExited) and str(event.rank) in job.exited_ranks)
