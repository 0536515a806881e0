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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from proto.events import WorkerHung
from proto.job import JobRecord

SLACK_S = 1.0  # a heartbeat's interval, for the condition to reach the coordinator


class HeldHangs:
    """One held hang per (job, attempt), with when its wait ends. In memory: a new leader
    decides the attempt's next hang report (the agents report a hang again while it lasts)
    or the network stall (``network_culprit.stalled_cut_off``) instead."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], tuple[WorkerHung, float]] = {}

    def hold(self, job: JobRecord, event: WorkerHung, until: float) -> bool:
        """Hold ``event``; False when a hang of this attempt is held already (this one
        would have the same verdict)."""
        key = (job.id, job.attempt)
        if key in self._held:
            return False
        self._held[key] = (event, until)
        return True

    def holding(self, job: JobRecord) -> bool:
        return (job.id, job.attempt) in self._held

    def ready(
        self, jobs: Mapping[str, JobRecord], now: float, evidence: Callable[[JobRecord], bool]
    ) -> list[tuple[JobRecord, WorkerHung]]:
        """The verdicts to give now: with the network's ``evidence`` in, or waited for long
        enough. A hang of an attempt that has ended is dropped: its fate is decided."""
        out = []
        for key, (event, until) in list(self._held.items()):
            job = jobs.get(key[0])
            if job is None or job.attempt != key[1] or job.state.terminal:
                del self._held[key]
            elif now >= until or evidence(job):
                del self._held[key]
                out.append((job, event))
        return out
