"""The one place where collectors and their detectors are registered for a node."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.collectors.base import Collector
from nodeagent.collectors.clock import ClockCollector
from nodeagent.collectors.clock_peer import PeerClock
from nodeagent.collectors.gpu import GpuCollector
from nodeagent.collectors.gpu_topology import GpuTopologyCollector
from nodeagent.collectors.nvme import NvmeLatencyCollector
from nodeagent.collectors.nvme_smart import NvmeSmartCollector
from nodeagent.collectors.nvme_udev import NvmeUdevCollector
from nodeagent.collectors.nvml import NvmlSession
from nodeagent.collectors.preemption import PreemptionCollector
from nodeagent.collectors.preflight import PreflightCollector, SpaceNeed
from nodeagent.config import AgentConfig
from nodeagent.detectors.base import Detector
from nodeagent.detectors.clock import ClockDriftDetector
from nodeagent.detectors.gpu import GpuPcieDetector, GpuThermalDetector, GpuXidDetector
from nodeagent.detectors.gpu_topology import GpuTopologyDetector
from nodeagent.detectors.nvme import NvmeLatencyDetector
from nodeagent.detectors.nvme_readonly import NvmeReadonlyDetector
from nodeagent.detectors.preemption import SpotNoticeDetector
from nodeagent.detectors.preflight import PreflightDetector


@dataclass
class Registered:
    collector: Collector
    detectors: list[Detector] = field(default_factory=list)


def build(config: AgentConfig) -> list[Registered]:
    entries = [preflight(config), *_nvme(config), *_gpu(config), _clock(config)]
    pre = config.preemption
    if pre.provider != "none":
        collector = PreemptionCollector(
            provider=pre.provider,
            interval_s=pre.interval_s,
            timeout_s=pre.timeout_s,
            aws_url=pre.aws_url,
            gcp_url=pre.gcp_url,
            azure_url=pre.azure_url,
            redetect_s=pre.redetect_s,
            gcp_deadline_s=pre.gcp_deadline_s,
        )
        entries.append(Registered(collector, [SpotNoticeDetector(config.node)]))
    return entries


def preflight(config: AgentConfig) -> Registered:
    """Also run alone by ``nodeagent --preflight``."""
    pre = config.preflight
    needs = [
        SpaceNeed("data", Path(pre.data_dir), pre.data_need_gb),
        SpaceNeed("checkpoint", Path(pre.checkpoint_dir), pre.checkpoint_need_gb),
    ]
    collector = PreflightCollector(
        config.roots(),
        needs=needs,
        interval_s=pre.interval_s,
        somaxconn_min=pre.somaxconn_min,
        shm_min_gb=pre.shm_min_gb,
    )
    return Registered(collector, [PreflightDetector(config.node)])


def clock_of(entries: list[Registered]) -> ClockCollector | None:
    """The clock collector, which also serves the ``resync_clock`` command."""
    return next((e.collector for e in entries if isinstance(e.collector, ClockCollector)), None)


def _clock(config: AgentConfig) -> Registered:
    clock = config.clock
    collector = ClockCollector(
        peer=PeerClock(interval_s=clock.peer_interval_s, timeout_s=clock.peer_timeout_s),
        interval_s=clock.interval_s,
        use_adjtimex=clock.adjtimex,
        chronyc=clock.chronyc,
        chrony_interval_s=clock.chrony_interval_s,
        skew_file=Path(clock.skew_file) if clock.skew_file else None,
        step_command=clock.step_command,
        step_timeout_s=clock.step_timeout_s,
        max_offset_ms=clock.max_offset_ms,
    )
    detector = ClockDriftDetector(
        config.node,
        max_offset_ms=clock.max_offset_ms,
        recover_ms=clock.recover_ms,
        confirm=clock.confirm,
        hold_s=clock.hold_s,
    )
    return Registered(collector, [detector])


def _nvme(config: AgentConfig) -> list[Registered]:
    roots, node, nvme = config.roots(), config.node, config.nvme
    readonly = NvmeReadonlyDetector(node)  # one state for the three sources
    entries = [
        Registered(
            NvmeLatencyCollector(roots, devices=nvme.devices, interval_s=nvme.interval_s),
            [
                NvmeLatencyDetector(
                    node, spike_us=nvme.spike_us, recover_us=nvme.recover_us, hold_s=nvme.hold_s
                ),
                readonly,
            ],
        ),
        Registered(
            NvmeSmartCollector(
                roots,
                command=nvme.smart_command,
                interval_s=nvme.smart_interval_s,
                timeout_s=nvme.smart_timeout_s,
            ),
            [readonly],
        ),
    ]
    if nvme.udev:
        udev = NvmeUdevCollector(roots, source=nvme.udev_source, devices=nvme.udev_devices)
        entries.append(Registered(udev, [readonly]))
    return entries


def _gpu(config: AgentConfig) -> list[Registered]:
    node, gpu = config.node, config.gpu
    nvml = NvmlSession(gpu.nvml_library)  # one per process: both GPU collectors share it
    return [
        Registered(
            GpuCollector(nvml, interval_s=gpu.interval_s),
            [
                GpuThermalDetector(
                    node,
                    warn_c=gpu.warn_c,
                    critical_c=gpu.critical_c,
                    hysteresis_c=gpu.hysteresis_c,
                    hold_s=gpu.thermal_hold_s,
                    confirm=gpu.thermal_confirm,
                ),
                GpuPcieDetector(
                    node,
                    min_gbps=gpu.pcie_min_gbps,
                    busy_pct=gpu.pcie_busy_pct,
                    replay_limit=gpu.pcie_replay_limit,
                    confirm=gpu.pcie_confirm,
                    hold_s=gpu.pcie_hold_s,
                ),
                GpuXidDetector(node),
            ],
        ),
        Registered(
            GpuTopologyCollector(nvml, interval_s=gpu.topology_interval_s),
            [
                GpuTopologyDetector(
                    node, expect_nvlink=gpu.expect_nvlink, confirm=gpu.topology_confirm
                )
            ],
        ),
    ]
