"""``node.preflight`` from ``preflight`` samples: the first result, then every change.

The coordinator refuses a node whose preflight failed, so the event carries every check;
it is repeated only when a check's verdict changes (free space drifting by a few MB, or
a value that stays bad, says nothing new). One node-wide ``node.preflight`` condition is
open while any check fails; its reason lists the failed checks, and a change in which
checks fail restates it.
"""

from __future__ import annotations

from nodeagent.collectors.preflight import PreflightSample
from nodeagent.detectors.latch import ConditionLatch
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import EventBase, NodePreflight


class PreflightDetector:
    def __init__(self, node: str) -> None:
        self.node = node
        self._verdicts: dict[str, bool] | None = None
        self._latch = ConditionLatch(
            ConditionKind.PREFLIGHT, node, "", severity=Severity.WARNING, confirm=1, hold_s=0.0
        )

    def observe(self, sample: PreflightSample) -> list[EventBase]:
        verdicts = {c.name: c.ok for c in sample.checks}
        failed = [f"{c.name} {c.value} (want {c.want})" for c in sample.checks if not c.ok]
        message = "preflight failed: " + "; ".join(failed) if failed else "preflight passed"
        change = self._latch.update(bool(failed), sample.time)
        if verdicts == self._verdicts:
            return []
        self._verdicts = verdicts
        condition: Condition | None = None
        if change is not None:
            condition = self._latch.record(change, sample.time, reason=message)
        elif self._latch.open:  # other checks fail now
            condition = self._latch.restate(sample.time, reason=message)
        return [
            NodePreflight(
                severity=Severity.WARNING if failed else Severity.INFO,
                node=self.node,
                ok=not failed,
                checks=sample.checks,
                message=message,
                condition=condition,
            )
        ]
