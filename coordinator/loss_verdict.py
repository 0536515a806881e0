"""When the verdict on a job's node that stopped beating may be given.

A node whose agent is cut off from the bus (its control link down, its agent restarting)
is away after the registry's missed beats, while its ranks may still train over the data
network; it is declared lost only when they do not. The evidence that they do is a rank
on another node reporting, in its own node's heartbeat, a step two past rank 0's newest word
(:func:`coordinator.reconcile.peers_stepped_on`). That evidence exists only two steps
after rank 0's word, and is in a peer's heartbeat only once its rank has rewritten its
beat file since. With short steps every peer has beaten since then by the time the node
is declared lost, and nothing waits. With long steps (a loaded host, a large model) the
verdict waits for one heartbeat of every other node of the job sent late enough to show
it, at most :data:`MAX_WAIT_S`: a node that is really gone costs about one heartbeat
more, never a healthy job's restart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from proto.events import NodeAway
from proto.job import JobRecord
from ringmaster.rankbeat import WRITE_EVERY_S

MAX_WAIT_S = 10.0
SLACK_S = 0.25  # a step's time varies, and a heartbeat spends some on the bus


def evidence_at(stepped_at: float | None, step_s: float | None) -> float | None:
    """The monotonic time after which a rank's beat shows two steps past rank 0's newest
    word (``stepped_at``) if the ranks still step; None without a word or a step time
    (there is nothing to wait for)."""
    if stepped_at is None or step_s is None:
        return None
    return stepped_at + 2 * step_s + WRITE_EVERY_S + SLACK_S


Decidable = Callable[[JobRecord, NodeAway, float], bool]


class AwaitedVerdicts:
    """Lost nodes whose verdict waits for their peers' word, by (job, attempt, node),
    with the time the evidence is due and the time the wait ends regardless. In memory: a
    new leader's registry declares a silent node lost again, and the verdict waits anew."""

    def __init__(self) -> None:
        self._due: dict[tuple[str, int, str], tuple[NodeAway, float, float]] = {}

    def wait(self, job: JobRecord, event: NodeAway, due: float, now: float) -> None:
        if event.node is not None:
            self._due[(job.id, job.attempt, event.node)] = (event, due, now + MAX_WAIT_S)

    def ready(
        self, jobs: Mapping[str, JobRecord], now: float, decidable: Decidable
    ) -> list[tuple[JobRecord, NodeAway]]:
        """The verdicts to give now: those ``decidable`` from the peers' beats, and those
        waited on for :data:`MAX_WAIT_S`. A verdict for an attempt that has ended is
        dropped: that attempt's fate is decided."""
        out = []
        for key, (event, due, until) in list(self._due.items()):
            job_id, attempt, _ = key
            job = jobs.get(job_id)
            if job is None or job.attempt != attempt or job.state.terminal:
                del self._due[key]
            elif now >= until or decidable(job, event, due):
                del self._due[key]
                out.append((job, event))
        return out
