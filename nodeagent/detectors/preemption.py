"""``spot.notice`` from ``preemption`` samples: once per notice, with its deadline.

A notice is terminal (the machine is going away), so there is no recovery event. It opens
a critical ``spot.notice`` condition (subject: the provider); when the notice disappears
(withdrawn, or a test clears it) the condition closes with no event, since the contract has
no kind for a withdrawn notice: the heartbeat's active set carries the change, and the
detector re-arms for the next notice.

A notice can also pass: its deadline goes by and the machine is still here (a maintenance
event that finished, a mistaken notice, a stop the provider never carried out), while the
metadata service may go on serving it (AWS's ``instance-action`` stays). Once the agent
has sampled :data:`PASSED_AFTER_S` past the deadline, the condition closes the same way,
saying so, and that notice is not taken again: only one with another deadline opens
anew. A notice first seen that long after its deadline opens nothing. The node's life then
returns it after its probation (``coordinator.node_life``).
"""

from __future__ import annotations

from datetime import datetime

from nodeagent.collectors.preemption import PreemptionSample
from nodeagent.detectors.latch import ConditionLatches
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import EventBase, SpotNotice

# s: a machine whose agent still samples this long after its notice's deadline was not
# taken (providers reclaim at the deadline, AWS and GCP within seconds of it)
PASSED_AFTER_S = 60.0


class SpotNoticeDetector:
    def __init__(self, node: str, passed_after_s: float = PASSED_AFTER_S) -> None:
        self.node = node
        self.passed_after_s = passed_after_s
        self._latches = ConditionLatches(
            ConditionKind.PREEMPTION, node, severity=Severity.CRITICAL, confirm=1, hold_s=0.0
        )
        self._withdrawn: list[Condition] = []
        self._passed: dict[str, datetime] = {}  # by provider: the deadline of a notice gone by

    def observe(self, sample: PreemptionSample) -> list[EventBase]:
        notice, provider = sample.notice, sample.provider
        if notice is None:
            self._passed.pop(provider, None)  # gone: the next notice is a new one
        elif sample.time - notice.deadline.timestamp() > self.passed_after_s:
            self._passed[provider] = notice.deadline
        gone_by = notice is not None and self._passed.get(provider) == notice.deadline
        latch = self._latches[provider]
        change = latch.update(notice is not None and not gone_by, sample.time)
        if change is None:
            return []
        if notice is None or gone_by:
            self._withdrawn.append(latch.record(change, sample.time, reason=_ended(sample)))
            return []
        left = notice.deadline.timestamp() - sample.time
        message = (
            f"{provider} preemption notice: {notice.action} at {notice.deadline:%H:%M:%S} UTC, "
            f"in {left:.0f} s ({notice.detail})"
        )
        return [
            SpotNotice(
                severity=Severity.CRITICAL,
                node=self.node,
                provider=provider,
                action=notice.action,
                deadline=notice.deadline,
                message=message,
                condition=latch.record(change, sample.time, reason=message),
            )
        ]

    def unannounced(self) -> list[Condition]:
        """Conditions closed since the last call with no event (withdrawn or passed
        notices)."""
        withdrawn, self._withdrawn = self._withdrawn, []
        return withdrawn


def _ended(sample: PreemptionSample) -> str:
    """Why a notice's condition closes: withdrawn, or passed with the node still up."""
    notice, provider = sample.notice, sample.provider
    if notice is None:
        return f"{provider} preemption notice withdrawn"
    late = sample.time - notice.deadline.timestamp()
    return (
        f"{provider} preemption notice passed: {notice.action} was due at "
        f"{notice.deadline:%H:%M:%S} UTC, {late:.0f} s ago, and this node is still up"
    )
