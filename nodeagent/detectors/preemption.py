"""``spot.notice`` from ``preemption`` samples: once per notice, with its deadline.

A notice is terminal (the machine is going away), so there is no recovery event. It opens
a critical ``spot.notice`` condition (subject: the provider); when the notice disappears
(withdrawn, or a test clears it) the condition closes with no event, since the contract has
no kind for a withdrawn notice: the heartbeat's active set carries the change, and the
detector re-arms for the next notice.
"""

from __future__ import annotations

from nodeagent.collectors.preemption import PreemptionSample
from nodeagent.detectors.latch import ConditionLatches
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import EventBase, SpotNotice


class SpotNoticeDetector:
    def __init__(self, node: str) -> None:
        self.node = node
        self._latches = ConditionLatches(
            ConditionKind.PREEMPTION, node, severity=Severity.CRITICAL, confirm=1, hold_s=0.0
        )
        self._withdrawn: list[Condition] = []

    def observe(self, sample: PreemptionSample) -> list[EventBase]:
        notice, provider = sample.notice, sample.provider
        latch = self._latches[provider]
        change = latch.update(notice is not None, sample.time)
        if change is None:
            return []
        if notice is None:
            reason = f"{provider} preemption notice withdrawn"
            self._withdrawn.append(latch.record(change, sample.time, reason=reason))
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
        """Conditions closed since the last call with no event (withdrawn notices)."""
        withdrawn, self._withdrawn = self._withdrawn, []
        return withdrawn
