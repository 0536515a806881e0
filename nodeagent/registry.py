"""The one place where collectors and their detectors are registered for a node."""

from __future__ import annotations

from dataclasses import dataclass, field

from nodeagent.collectors.base import Collector
from nodeagent.collectors.nvme import NvmeLatencyCollector
from nodeagent.config import AgentConfig
from nodeagent.detectors.base import Detector
from nodeagent.detectors.nvme import NvmeLatencyDetector


@dataclass
class Registered:
    collector: Collector
    detectors: list[Detector] = field(default_factory=list)


def build(config: AgentConfig) -> list[Registered]:
    roots = config.roots()
    nvme = config.nvme
    return [
        Registered(
            NvmeLatencyCollector(roots, devices=nvme.devices, interval_s=nvme.interval_s),
            [
                NvmeLatencyDetector(
                    config.node,
                    spike_us=nvme.spike_us,
                    recover_us=nvme.recover_us,
                    hold_s=nvme.hold_s,
                )
            ],
        ),
    ]
