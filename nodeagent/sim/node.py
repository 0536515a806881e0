"""A simulated node: a sysfs tree whose counters a real kernel would plausibly write.

The node agent on a simulated node is the real agent with its roots pointed here, so the
simulator's job is only to keep these files moving like hardware does, and to bend them on
``inject``. Files are replaced atomically (write a temporary file, rename it over) so a
reader never sees half a line.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.collectors.base import Roots
from nodeagent.sim.gpus import SimulatedGpus
from nodeagent.sim.metadata import MetadataServer
from proto.faults import (
    ClearFault,
    ClockOffsetFault,
    GpuTempFault,
    LinkFault,
    NvmeLatencyFault,
    NvmeReadonlyFault,
    PcieBwFault,
    SpotNoticeFault,
    parse_fault,
)

BASELINE_US = 20.0  # healthy datacentre NVMe under a training job's read load
NOISE_US = 2.0  # ± per tick
IOPS_RANGE = (3000.0, 6000.0)
READ_SHARE = (0.6, 0.8)
SECTORS_PER_IO = 8  # 4 KiB I/Os in 512-byte sectors
# The data link the agent watches (its network.data_interface), up: nothing opens.
DATA_LINK = {"carrier": "1", "operstate": "up", "carrier_changes": "1"} | {
    f"statistics/{c}": "0" for c in ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped")
}
# TCP's counters of a node that has sent nothing yet: a node in a network namespace of its
# own reads its real ones instead (``network.tcp_procfs``), which a loss fault moves
TCP_SNMP = (
    "Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails "
    "EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors\n"
    "Tcp: 1 200 120000 -1 0 0 0 0 0 0 0 0 0 0 0\n"
)


@dataclass
class _Disk:
    """One namespace's cumulative counters; times in ns as the kernel keeps them."""

    name: str
    dir: Path
    ios: list[int] = field(default_factory=lambda: [0, 0])  # read, write
    merges: list[int] = field(default_factory=lambda: [0, 0])
    sectors: list[int] = field(default_factory=lambda: [0, 0])
    ns: list[int] = field(default_factory=lambda: [0, 0])
    in_flight: int = 0
    busy_ns: int = 0
    flushes: int = 0
    flush_ns: int = 0
    carry: float = 0.0  # fraction of an I/O owed to the next tick
    readonly: bool = False

    def stat_line(self) -> str:
        """The 17-field layout of Documentation/block/stat.rst (Linux 5.5+); ticks in ms."""
        ms = [n // 1_000_000 for n in self.ns]
        queue_ms = (sum(self.ns) + self.flush_ns) // 1_000_000
        fields = [
            self.ios[0], self.merges[0], self.sectors[0], ms[0],
            self.ios[1], self.merges[1], self.sectors[1], ms[1],
            self.in_flight, self.busy_ns // 1_000_000, queue_ms,
            0, 0, 0, 0,
            self.flushes, self.flush_ns // 1_000_000,
        ]  # fmt: skip
        return " ".join(f"{v:8d}" for v in fields) + "\n"


class SimulatedNode:
    """``<root>/sys/block/nvme{i}n1/{stat,ro}`` and ``<root>/proc``, advanced by :meth:`tick`."""

    def __init__(
        self,
        root: Path,
        node: str,
        nvme_devices: int = 2,
        *,
        gpus: int = 0,
        seed: int | None = None,
        nvml_cache: Path | None = None,
        metadata: MetadataServer | None = None,
    ) -> None:
        self.root = root
        self.node = node
        self.roots = Roots(sysfs=root / "sys", procfs=root / "proc", dev=root / "dev")
        self.metadata = metadata  # the node's cloud metadata service, for spot notices
        self._spot: SpotNoticeFault | None = None
        self._rng = random.Random(seed)
        cache = nvml_cache or root.parent / ".nvml-cache"
        self.gpus = SimulatedGpus(root / "nvml", gpus, cache, self._rng) if gpus else None
        self._latency: dict[str | None, NvmeLatencyFault] = {}  # None: all devices
        self._readonly: NvmeReadonlyFault | None = None
        self._disks: dict[str, _Disk] = {}
        self.roots.procfs.mkdir(parents=True, exist_ok=True)
        # What preflight reads: a tuned backlog, and a /dev/shm (the tree's own disk).
        # Host settings a test or an operator laid down before the simulator started stay.
        _write_absent(self.roots.procfs / "sys" / "net" / "core" / "somaxconn", "65535\n")
        _write_absent(self.roots.procfs / "net" / "snmp", TCP_SNMP)
        (root / "dev" / "shm").mkdir(parents=True, exist_ok=True)
        for name, value in DATA_LINK.items():
            _write_new(self.roots.sysfs / "class" / "net" / "data0" / name, f"{value}\n")
        block = self.roots.sysfs / "block"
        block.mkdir(parents=True, exist_ok=True)
        for i in range(nvme_devices):
            name = f"nvme{i}n1"
            # Like real sysfs: /sys/block/<dev> links to the device under /sys/devices.
            target = Path("..", "devices", "virtual", "nvme", f"nvme{i}", name)
            (block / target).mkdir(parents=True, exist_ok=True)
            link = block / name
            if not link.is_symlink():
                link.symlink_to(target)
            disk = _Disk(name, link)
            self._disks[name] = disk
            _write(disk.dir / "stat", disk.stat_line())
        self.skew_file = root / "clock" / "skew_ms"
        self.skew_file.parent.mkdir(parents=True, exist_ok=True)
        self.skew_file.unlink(missing_ok=True)
        self._clock: ClockOffsetFault | None = None
        self.smart_dir = root / "smart"
        self.smart_dir.mkdir(parents=True, exist_ok=True)
        self._set_readonly(False)

    def tick(self, dt: float) -> None:
        """Advance every device by ``dt`` seconds of I/O and rewrite its stat file."""
        for disk in self._disks.values():
            self._advance(disk, dt)
            _write(disk.dir / "stat", disk.stat_line())
        if self.gpus is not None:
            self.gpus.tick(dt)
        if self._clock is not None and not self.skew_file.exists():
            self._clock = None  # the agent's resync command stepped the clock back

    def _advance(self, disk: _Disk, dt: float) -> None:
        rng = self._rng
        owed = rng.uniform(*IOPS_RANGE) * dt + disk.carry
        n = int(owed)
        disk.carry = owed - n
        latency_us = self._latency_us(disk.name) + rng.uniform(-NOISE_US, NOISE_US)
        per_io_ns = max(1, round(latency_us * 1000))
        reads = n if disk.readonly else round(n * rng.uniform(*READ_SHARE))
        for i, count in enumerate((reads, n - reads)):
            disk.ios[i] += count
            disk.merges[i] += count // 16
            disk.sectors[i] += count * SECTORS_PER_IO
            disk.ns[i] += count * per_io_ns
        flushes = (n - reads) // 64
        disk.flushes += flushes
        disk.flush_ns += flushes * per_io_ns
        disk.busy_ns += min(round(dt * 1e9), n * per_io_ns)
        # Queued I/O only while a latency fault holds the device: a healthy simulated
        # device completes its I/O between ticks, so a tick that runs late under load
        # (the simulator shares the host with training) is an idle window, not the
        # stalled queue an agent would rightly report on a real device.
        slow = device_fault(self._latency, disk.name) is not None
        disk.in_flight = rng.randint(1, 4) if slow else 0

    def _latency_us(self, device: str) -> float:
        fault = device_fault(self._latency, device)
        return fault.latency_us if fault else BASELINE_US

    def apply(self, fault: str) -> None:
        """Apply one fault in ``coordinatorctl inject`` form; ValueError says what is wrong."""
        parsed = parse_fault(fault)
        if isinstance(parsed, NvmeLatencyFault):
            if parsed.device is None:
                self._latency = {None: parsed}
            elif parsed.device in self._disks:
                self._latency[parsed.device] = parsed
            else:
                have = ", ".join(self._disks)
                raise ValueError(f"{self.node} has no device {parsed.device} (it has {have})")
        elif isinstance(parsed, NvmeReadonlyFault):
            self._readonly = parsed if parsed.readonly else None
            self._set_readonly(parsed.readonly)
        elif isinstance(parsed, GpuTempFault | PcieBwFault | LinkFault):
            if self.gpus is None:
                raise ValueError(f"{self.node} has no GPUs")
            try:
                self.gpus.apply(parsed)
            except ValueError as exc:
                raise ValueError(f"{self.node}: {exc}") from None
        elif isinstance(parsed, ClockOffsetFault):
            self._set_skew(parsed)
        elif isinstance(parsed, SpotNoticeFault):
            if self.metadata is None:
                raise ValueError(f"{self.node} has no metadata service to give notice")
            self.metadata.preempt(parsed.deadline_s)
            self._spot = parsed
        elif isinstance(parsed, ClearFault):
            self._set_skew(None)
            if self.metadata is not None:
                self.metadata.withdraw()
            self._spot = None
            self._latency = {}
            self._readonly = None
            self._set_readonly(False)
            if self.gpus is not None:
                self.gpus.clear()
        else:  # process faults (PROCESS_FAULTS): coordinatorctl carries those out itself
            name = fault.strip().partition("=")[0]
            raise ValueError(f"fault {name} is not the simulator's: coordinatorctl does it")

    def _set_skew(self, fault: ClockOffsetFault | None) -> None:
        """The agent adds this file's milliseconds to its clock readings (``clock.skew_file``);
        a resync removes the file (``clock.step_command``)."""
        self._clock = fault
        if fault is None:
            self.skew_file.unlink(missing_ok=True)
        else:
            _write(self.skew_file, f"{fault.offset_ms:g}\n")

    def _set_readonly(self, readonly: bool) -> None:
        """The kernel flag, and the controller's SMART log (``nvme smart-log -o json``
        layout, read by the agent through ``cat``): critical_warning bit 3 is media
        read-only."""
        for disk in self._disks.values():
            disk.readonly = readonly
            _write(disk.dir / "ro", "1\n" if readonly else "0\n")
            log = {"critical_warning": 8 if readonly else 0, "temperature": 313}
            log |= {"avail_spare": 100, "spare_thresh": 10, "percent_used": 2}
            _write(self.smart_dir / f"{disk.name}.json", json.dumps(log, indent=2) + "\n")

    def faults(self) -> list[str]:
        """The active faults in their canonical inject form."""
        active = [str(f) for f in self._latency.values()]
        active += [str(self._readonly)] if self._readonly else []
        active += [str(self._clock)] if self._clock else []
        active += [str(self._spot)] if self._spot else []
        return active + (self.gpus.faults() if self.gpus is not None else [])


def _write_new(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, text)


def _write_absent(path: Path, text: str) -> None:
    if not path.exists():
        _write_new(path, text)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="ascii")
    tmp.replace(path)


def device_fault(
    faults: dict[str | None, NvmeLatencyFault], device: str
) -> NvmeLatencyFault | None:
    """The fault that holds ``device``: its own, else the node-wide one (key None)."""
    return faults.get(device) or faults.get(None)
