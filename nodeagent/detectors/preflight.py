"""``node.preflight`` from ``preflight`` samples: the first result, then every change.

The coordinator refuses a node whose required check failed, so the event carries every
check; it is repeated only when a check's verdict changes (free space drifting by a few
MB, or a value that stays bad, says nothing new). One node-wide ``node.preflight``
condition is open while any check fails, so ``coordinatorctl status`` shows warnings too:
at ``warning`` severity while a required check fails (the node is refused), at ``info``
while only warnings stand (advisory: the node stays ready). Its reason lists the failed
checks, then the warnings; a change in which checks fail restates it.
"""

from __future__ import annotations

from nodeagent.collectors.preflight import PreflightSample
from nodeagent.detectors.latch import ConditionLatch
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import EventBase, NodePreflight, PreflightCheck


class PreflightDetector:
    def __init__(self, node: str) -> None:
        self.node = node
        self._verdicts: dict[str, bool] | None = None
        self._latch = ConditionLatch(
            ConditionKind.PREFLIGHT, node, "", severity=Severity.WARNING, confirm=1, hold_s=0.0
        )

    def observe(self, sample: PreflightSample) -> list[EventBase]:
        verdicts = {c.name: c.ok for c in sample.checks}
        refused = any(not c.ok and c.required for c in sample.checks)
        failing = not all(verdicts.values())  # required or not
        message = summary(sample.checks)
        change = self._latch.update(failing, sample.time)
        if verdicts == self._verdicts:
            return []
        self._verdicts = verdicts
        # open: advisory (info) unless a required check fails; closing keeps what it was
        severity = Severity.WARNING if refused else Severity.INFO if failing else None
        condition: Condition | None = None
        if change is not None:
            condition = self._latch.record(change, sample.time, reason=message, severity=severity)
        elif self._latch.open:  # other checks fail now
            condition = self._latch.restate(sample.time, reason=message, severity=severity)
        return [
            NodePreflight(
                severity=Severity.WARNING if failing else Severity.INFO,
                node=self.node,
                ok=not refused,
                checks=sample.checks,
                message=message,
                condition=condition,
            )
        ]


def summary(checks: list[PreflightCheck]) -> str:
    """The verdict in words: the failed checks, the warnings, what the agent changed."""
    failed = [_shown(c) for c in checks if not c.ok and c.required]
    warned = [_shown(c) for c in checks if not c.ok and not c.required]
    if failed:
        parts = ["preflight failed: " + "; ".join(failed)]
        parts += ["warning: " + "; ".join(warned)] if warned else []
    elif warned:
        parts = ["preflight passed with warnings: " + "; ".join(warned)]
    else:
        parts = ["preflight passed"]
    fixed = [f"{c.name} {c.fixed_from} -> {c.value}" for c in checks if c.fixed_from]
    parts += ["set " + ", ".join(fixed)] if fixed else []
    return "; ".join(parts)


def _shown(check: PreflightCheck) -> str:
    return f"{check.name} {check.value} (want {check.want})"
