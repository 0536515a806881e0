"""``spot.notice`` from ``preemption`` samples: once per notice, with its deadline.

A notice is terminal (the machine is going away), so there is no recovery event; when a
notice disappears (withdrawn, or a test clears it) the detector re-arms for the next one.
"""

from __future__ import annotations

from datetime import datetime

from nodeagent.collectors.base import Sample
from proto.events import EventBase, Severity, SpotNotice


class SpotNoticeDetector:
    collector = "preemption"

    def __init__(self, node: str) -> None:
        self.node = node
        self._active = False

    def observe(self, sample: Sample) -> list[EventBase]:
        notice = sample.values.get("notice")
        if not notice:
            self._active = False
            return []
        if self._active:
            return []
        self._active = True
        provider = str(sample.values.get("provider", ""))
        deadline = datetime.fromisoformat(notice["deadline"])
        left = deadline.timestamp() - sample.time
        return [
            SpotNotice(
                severity=Severity.CRITICAL,
                node=self.node,
                provider=provider,
                action=str(notice["action"]),
                deadline=deadline,
                message=f"{provider} preemption notice: {notice['action']} at "
                f"{deadline:%H:%M:%S} UTC, in {left:.0f} s ({notice.get('detail', '')})",
            )
        ]
