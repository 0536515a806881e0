"""When the verdict on a hang no node can pin on a rank of its own may be given.

An agent reports ``culprit_unknown`` when every stalled rank on its node waits in a
collective: the culprit is on another node, or it is the network. The network's word
(``net.peer``, a peer a node's probes cannot reach) takes that node's probes a few seconds
to confirm (``Heartbeat.probe_confirm_s``), while the hang watch judges within its 3 s
floor, so the first word of a partition is often the hang. Decided at once, the job would
restart with the cut-off node in it, and the next attempt would wait on a rendezvous that
node cannot reach. So the verdict waits until the job's nodes' probes can have spoken, or
until the network names a suspect, and is then given with the evidence there is. A hang
with a culprit (a stopped process, a silent beat) is never held.

A job that steps past the hang's step while its verdict waits was slow, not hung (a
starved machine stretches one step past the floor; every rank then looks stalled in a
collective): the nodes' newest word is progress, and the held hang is dropped.

The held hang is part of the job's record (``JobRecord.held_hang``, wall time), so a
leader taking over gives the verdict its predecessor was waiting to give.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from proto.conditions import Severity
from proto.events import WorkerHung
from proto.job import HeldHang, JobRecord, JobState

SLACK_S = 1.0  # a heartbeat's interval, for the condition to reach the coordinator
WAITING = frozenset({JobState.RUNNING, JobState.PAUSED, JobState.CHECKPOINTING})


def hold(job: JobRecord, event: WorkerHung, until: float) -> bool:
    """Hold ``event`` until ``until``; False when a hang of this attempt is held already
    (this one would have the same verdict)."""
    if job.held_hang is not None and job.held_hang.attempt == job.attempt:
        return False
    job.held_hang = HeldHang(
        node=event.node or "",
        rank=event.rank,
        attempt=event.attempt,
        step=event.step,
        evidence=event.evidence,
        until=until,
    )
    return True


def ready(
    jobs: Mapping[str, JobRecord], now: float, evidence: Callable[[JobRecord], bool]
) -> list[tuple[JobRecord, WorkerHung]]:
    """The held hangs whose verdict is due: the network's ``evidence`` is in, or the wait
    is over. A hang of an attempt that has moved on is dropped: its fate is decided; so is
    one the job has stepped past since: it was a slow step."""
    out = []
    for job in jobs.values():
        held = job.held_hang
        if held is None:
            continue
        if held.attempt != job.attempt or job.state not in WAITING or job.step > held.step:
            job.held_hang = None
        elif now >= held.until or evidence(job):
            job.held_hang = None
            out.append((job, _event(job, held)))
    return out


def _event(job: JobRecord, held: HeldHang) -> WorkerHung:
    return WorkerHung(
        node=held.node,
        job=job.id,
        rank=held.rank,
        attempt=held.attempt,
        step=held.step,
        severity=Severity.CRITICAL,
        evidence=held.evidence,
        culprit_unknown=True,
        message=f"rank {held.rank} on {held.node} waits in a collective ({held.evidence})",
    )
