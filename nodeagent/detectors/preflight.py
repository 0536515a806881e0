"""``node.preflight`` from ``preflight`` samples: the first result, then every change.

The coordinator refuses a node whose preflight failed, so the event carries every check;
it is repeated only when a check's verdict changes (free space drifting by a few MB, or
a value that stays bad, says nothing new).
"""

from __future__ import annotations

from nodeagent.collectors.base import Sample
from proto.events import EventBase, NodePreflight, PreflightCheck, Severity


class PreflightDetector:
    collector = "preflight"

    def __init__(self, node: str) -> None:
        self.node = node
        self._verdicts: dict[str, bool] | None = None

    def observe(self, sample: Sample) -> list[EventBase]:
        checks = [PreflightCheck(**c) for c in sample.values.get("checks", [])]
        verdicts = {c.name: c.ok for c in checks}
        if verdicts == self._verdicts:
            return []
        self._verdicts = verdicts
        ok = all(verdicts.values())
        failed = [f"{c.name} {c.value} (want {c.want})" for c in checks if not c.ok]
        message = "preflight passed" if ok else "preflight failed: " + "; ".join(failed)
        return [
            NodePreflight(
                severity=Severity.INFO if ok else Severity.WARNING,
                node=self.node,
                ok=ok,
                checks=checks,
                message=message,
            )
        ]
