"""The one place where collectors and their detectors are registered for a node.

Each entry pairs a collector with the detectors that read its samples; :class:`Registered`
is generic over the sample type, so mypy refuses a detector given samples it cannot read.
Detectors take their settings section whole: their thresholds have one name and one
default, in :mod:`nodeagent.config`. Detectors judge time on their samples' stamps; the
collectors that read time themselves (the clock's, preemption's, the XID watcher's) are
given the agent's clock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from nodeagent.collectors.base import Collector, Sample
from nodeagent.collectors.clock import ClockCollector, ClockSample
from nodeagent.collectors.clock_peer import PeerClock
from nodeagent.collectors.gpu import GpuCollector
from nodeagent.collectors.gpu_topology import GpuTopologyCollector
from nodeagent.collectors.nic import NicCollector
from nodeagent.collectors.nvme import NvmeLatencyCollector
from nodeagent.collectors.nvme_smart import NvmeSmartCollector
from nodeagent.collectors.nvme_udev import NvmeUdevCollector
from nodeagent.collectors.nvml import NvmlSession
from nodeagent.collectors.preemption import PreemptionCollector
from nodeagent.collectors.preflight import PreflightCollector, PreflightSample, SpaceNeed
from nodeagent.collectors.rdma import RdmaCollector
from nodeagent.collectors.sysctl import SOMAXCONN, Tunable, may_fix
from nodeagent.collectors.tcp import TcpCollector
from nodeagent.config import AgentConfig, resolve_data_interface
from nodeagent.detectors.base import Detector
from nodeagent.detectors.clock import ClockDriftDetector
from nodeagent.detectors.gpu import GpuThermalDetector, GpuXidDetector
from nodeagent.detectors.gpu_topology import GpuTopologyDetector
from nodeagent.detectors.link import NicLinkDetector, RdmaPortDetector
from nodeagent.detectors.nvme import NvmeLatencyDetector
from nodeagent.detectors.nvme_readonly import NvmeReadonlyDetector
from nodeagent.detectors.pcie import GpuPcieDetector
from nodeagent.detectors.preemption import SpotNoticeDetector
from nodeagent.detectors.preflight import PreflightDetector
from nodeagent.detectors.retrans import TcpRetransDetector
from ringmaster.clock import SYSTEM, Clock

S = TypeVar("S", bound=Sample)


@dataclass
class Registered(Generic[S]):
    collector: Collector[S]
    detectors: list[Detector[S]] = field(default_factory=list)


def build(config: AgentConfig, clock: Clock = SYSTEM) -> list[Registered[Any]]:
    entries = [preflight(config), *_nvme(config), *_gpu(config, clock), _clock(config, clock)]
    entries += _network(config)
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
            clock=clock,
        )
        entries.append(Registered(collector, [SpotNoticeDetector(config.node)]))
    return entries


def preflight(config: AgentConfig) -> Registered[PreflightSample]:
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
        tunables=[Tunable("somaxconn", SOMAXCONN, pre.somaxconn_min)],
        shm_min_gb=pre.shm_min_gb,
        fix=pre.fix and may_fix(os.environ, os.geteuid()),
    )
    return Registered(collector, [PreflightDetector(config.node)])


def clock_of(entries: list[Registered[Any]]) -> ClockCollector | None:
    """The clock collector, which also serves the ``resync_clock`` command."""
    return next((e.collector for e in entries if isinstance(e.collector, ClockCollector)), None)


def _clock(config: AgentConfig, clock: Clock) -> Registered[ClockSample]:
    settings = config.clock
    peer = PeerClock(
        interval_s=settings.peer_interval_s, timeout_s=settings.peer_timeout_s, clock=clock
    )
    collector = ClockCollector(
        peer=peer,
        interval_s=settings.interval_s,
        use_adjtimex=settings.adjtimex,
        chronyc=settings.chronyc,
        chrony_interval_s=settings.chrony_interval_s,
        skew_file=Path(settings.skew_file) if settings.skew_file else None,
        step_command=settings.step_command,
        step_timeout_s=settings.step_timeout_s,
        max_offset_ms=settings.max_offset_ms,
    )
    return Registered(collector, [ClockDriftDetector(config.node, settings)])


def _nvme(config: AgentConfig) -> list[Registered[Any]]:
    roots, node, nvme = config.roots(), config.node, config.nvme
    readonly = NvmeReadonlyDetector(node)  # one state for the three sources
    latency = NvmeLatencyCollector(roots, devices=nvme.devices, interval_s=nvme.interval_s)
    smart = NvmeSmartCollector(
        roots,
        command=nvme.smart_command,
        interval_s=nvme.smart_interval_s,
        timeout_s=nvme.smart_timeout_s,
    )
    entries: list[Registered[Any]] = [
        Registered(latency, [NvmeLatencyDetector(node, nvme), readonly]),
        Registered(smart, [readonly]),
    ]
    if nvme.udev:
        udev = NvmeUdevCollector(roots, source=nvme.udev_source, devices=nvme.udev_devices)
        entries.append(Registered(udev, [readonly]))
    return entries


def _network(config: AgentConfig) -> list[Registered[Any]]:
    roots, node, net = config.roots(), config.node, config.network
    data = resolve_data_interface(net, roots)
    nic = replace(roots, sysfs=Path(net.nic_sysfs)) if net.nic_sysfs else roots
    tcp = replace(roots, procfs=Path(net.tcp_procfs)) if net.tcp_procfs else roots
    return [
        Registered(NicCollector(nic, net.interval_s), [NicLinkDetector(node, net, data)]),
        Registered(TcpCollector(tcp, net.interval_s), [TcpRetransDetector(node, net)]),
        Registered(RdmaCollector(roots, net.interval_s), [RdmaPortDetector(node, net)]),
    ]


def _gpu(config: AgentConfig, clock: Clock) -> list[Registered[Any]]:
    node, gpu = config.node, config.gpu
    nvml = NvmlSession(gpu.nvml_library)  # one per process: both GPU collectors share it
    health = GpuCollector(nvml, interval_s=gpu.interval_s, clock=clock)
    topology = GpuTopologyCollector(nvml, interval_s=gpu.topology_interval_s)
    return [
        Registered(
            health,
            [GpuThermalDetector(node, gpu), GpuPcieDetector(node, gpu), GpuXidDetector(node)],
        ),
        Registered(topology, [GpuTopologyDetector(node, gpu)]),
    ]
