"""Topology events from ``gpu_topology`` samples: the matrix, and degraded GPU pairs.

A pair expected on NVLink that is found on PCIe (or with fewer links) makes all-reduce
over it several times slower, so the coordinator refuses such a node at admission and
raises a critical event at run time. What is expected comes from ``expect_nvlink``:

* ``all``: every pair on NVLink (HGX/DGX boards), from the first sample on;
* ``baseline``: the pairs on NVLink in the first complete matrix, with at least as many
  links (a node that boots degraded is not caught; use ``all`` where boards are uniform);
* ``none``: no expectation; only the ``topology`` matrix is published.

Each degraded pair is one ``topology.degraded`` condition (subject ``"A-B"``, critical;
value: the NVLinks found, threshold: those expected).
"""

from __future__ import annotations

import re

from nodeagent.collectors.gpu_topology import GpuTopologySample, render
from nodeagent.config import GpuSettings
from nodeagent.detectors.latch import Change, ConditionLatches
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import EventBase, Topology, TopologyDegraded

_NV = re.compile(r"NV(\d+)")


def nvlinks(cell: str) -> int:
    match = _NV.fullmatch(cell)
    return int(match[1]) if match else 0


class GpuTopologyDetector:
    def __init__(self, node: str, settings: GpuSettings) -> None:
        self.node = node
        self.expect_nvlink = settings.expect_nvlink
        self._matrix: list[list[str]] | None = None
        self._expected: dict[tuple[int, int], str] | None = None
        self._latches = ConditionLatches(
            ConditionKind.TOPOLOGY,
            node,
            severity=Severity.CRITICAL,
            confirm=settings.topology_confirm,
            hold_s=0.0,
        )

    def observe(self, sample: GpuTopologySample) -> list[EventBase]:
        labels, matrix = sample.gpus, sample.matrix
        events: list[EventBase] = []
        if matrix != self._matrix:
            self._matrix = matrix
            events.append(
                Topology(
                    node=self.node,
                    gpus=labels,
                    matrix=matrix,
                    message=f"GPU topology of {len(labels)} GPUs\n{render(labels, matrix)}",
                )
            )
        expected = self._expectation(matrix)
        for (a, b), want in sorted(expected.items()):
            found = matrix[a][b] if a < len(matrix) and b < len(matrix) else "?"
            latch = self._latches[f"{a}-{b}"]
            links, wanted = nvlinks(found), max(1, nvlinks(want))
            change = latch.update(None if found == "?" else links < wanted, sample.time)
            if change is not None:
                reason = _message(a, b, want, found, change)
                condition = latch.record(
                    change, sample.time, reason=reason, value=links, threshold=wanted
                )
                events.append(self._event(a, b, want, found, condition))
        return events

    def _expectation(self, matrix: list[list[str]]) -> dict[tuple[int, int], str]:
        if self._expected is None:
            pairs = [(a, b) for a in range(len(matrix)) for b in range(a + 1, len(matrix))]
            if self.expect_nvlink == "all":
                self._expected = dict.fromkeys(pairs, "NV")
            elif self.expect_nvlink == "none":
                self._expected = {}
            elif any(matrix[a][b] == "?" for a, b in pairs):
                return {}  # a baseline needs every pair
            else:
                self._expected = {
                    p: matrix[p[0]][p[1]] for p in pairs if nvlinks(matrix[p[0]][p[1]])
                }
        return self._expected

    def _event(
        self, a: int, b: int, want: str, found: str, condition: Condition
    ) -> TopologyDegraded:
        return TopologyDegraded(
            severity=Severity.CRITICAL if condition.active else Severity.INFO,
            node=self.node,
            gpu_a=a,
            gpu_b=b,
            expected=want,
            found=found,
            recovered=not condition.active,
            message=condition.reason,
            condition=condition,
        )


def _message(a: int, b: int, want: str, found: str, change: Change) -> str:
    if change is Change.CLEARED:
        return f"GPU{a}-GPU{b} back on {found}"
    return f"GPU{a}-GPU{b} on {found}, expected {want if want != 'NV' else 'NVLink'}"
