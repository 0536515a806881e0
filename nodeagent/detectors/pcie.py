"""``pcie.degraded`` from ``gpu`` samples: a GPU's PCIe link too slow while the GPU is busy,
or replaying packets."""

from __future__ import annotations

from typing import NamedTuple

from nodeagent.collectors.gpu import GpuHealthSample, GpuReading
from nodeagent.config import GpuSettings
from nodeagent.detectors.latch import Change, ConditionLatches
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import EventBase, PcieDegraded


class Evidence(NamedTuple):
    """What one sample says about a link: ``bad`` None is no evidence; ``value`` and
    ``threshold`` are what it was judged on (GB/s, or replays since the last sample)."""

    bad: bool | None
    value: float | None = None
    threshold: float | None = None


class GpuPcieDetector:
    """A GPU's PCIe link is degraded when, while the GPU is busy (utilisation at least
    ``pcie_busy_pct``), both directions move less than ``pcie_min_gbps`` (0 turns this off:
    what a job moves over PCIe is its own business), or when the link replay counter grows
    by ``pcie_replay_limit`` or more between two samples (0 turns this off). One
    ``pcie.degraded`` condition per GPU."""

    def __init__(self, node: str, settings: GpuSettings) -> None:
        self.node = node
        self.settings = settings
        self._latches = ConditionLatches(
            ConditionKind.PCIE,
            node,
            severity=Severity.WARNING,
            confirm=settings.pcie_confirm,
            hold_s=settings.pcie_hold_s,
        )
        self._replays: dict[int, int] = {}

    def observe(self, sample: GpuHealthSample) -> list[EventBase]:
        events: list[EventBase] = []
        for gpu in sample.gpus:
            latch = self._latches[str(gpu.index)]
            evidence = self._evidence(gpu)
            change = latch.update(evidence.bad, sample.time)
            if change is not None:
                condition = latch.record(
                    change,
                    sample.time,
                    reason=_message(gpu, change),
                    value=evidence.value,
                    threshold=evidence.threshold,
                )
                events.append(self._event(gpu, condition))
        return events

    def _evidence(self, gpu: GpuReading) -> Evidence:
        """A check that trips is the evidence; else, when the floor is watched, only a busy
        GPU's throughput can say the link is good again; else the replays say it."""
        s = self.settings
        floor: Evidence | None = None
        tx, rx, util = gpu.pcie_tx_gbps, gpu.pcie_rx_gbps, gpu.util_pct
        if s.pcie_min_gbps > 0:
            if tx is None or rx is None or util is None or util < s.pcie_busy_pct:
                floor = Evidence(None)  # an idle GPU says nothing about its link's bandwidth
            else:
                floor = Evidence(max(tx, rx) < s.pcie_min_gbps, max(tx, rx), s.pcie_min_gbps)
        replays: Evidence | None = None
        count, last = gpu.pcie_replay, self._replays.get(gpu.index)
        if count is not None:
            self._replays[gpu.index] = count
            if s.pcie_replay_limit > 0 and last is not None and count >= last:
                grown = count - last
                replays = Evidence(grown >= s.pcie_replay_limit, grown, s.pcie_replay_limit)
        for tripped in (floor, replays):
            if tripped is not None and tripped.bad:
                return tripped
        if floor is not None:
            return floor
        return replays if replays is not None else Evidence(None)

    def _event(self, gpu: GpuReading, condition: Condition) -> PcieDegraded:
        return PcieDegraded(
            severity=Severity.WARNING if condition.active else Severity.INFO,
            node=self.node,
            gpu=gpu.index,
            tx_gbps=gpu.pcie_tx_gbps or 0.0,
            rx_gbps=gpu.pcie_rx_gbps or 0.0,
            expected_gbps=self.settings.pcie_min_gbps,
            replay_count=gpu.pcie_replay or 0,
            recovered=not condition.active,
            message=condition.reason,
            condition=condition,
        )


def _message(gpu: GpuReading, change: Change) -> str:
    state = "recovered" if change is Change.CLEARED else "degraded"
    tx, rx = gpu.pcie_tx_gbps or 0.0, gpu.pcie_rx_gbps or 0.0
    return (
        f"GPU {gpu.index} PCIe {state}: TX {tx:g} GB/s, RX {rx:g} GB/s, {gpu.pcie_replay} replays"
    )
