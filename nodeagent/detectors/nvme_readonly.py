"""``nvme.readonly`` from three sources that see the same fault at different speeds.

The kernel's read-only flag of a disk is polled in ``/sys/block/<dev>/ro`` (``nvme``
samples) and announced at once by a ``DISK_RO`` change uevent (``nvme_udev`` samples); the
controller's own verdict is bit 3 of the SMART critical warning (``nvme_smart`` samples),
which can be set before the kernel notices. A device is read-only while either the kernel
flag or the SMART bit says so: one ``nvme.readonly`` condition per device, opened and
closed by one event each, carrying the source that caused the change, so the three sources
never produce three events for one fault.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodeagent.collectors.nvme import NvmeLatencySample
from nodeagent.collectors.nvme_smart import NvmeSmartSample
from nodeagent.collectors.nvme_udev import NvmeUdevSample
from nodeagent.detectors.latch import Change, ConditionLatches
from proto.conditions import ConditionKind, Severity
from proto.events import EventBase, NvmeReadonly

NvmeSample = NvmeLatencySample | NvmeSmartSample | NvmeUdevSample
WHY = {"sysfs": "the kernel's ro flag", "udev": "a DISK_RO uevent", "smart": "SMART"}


@dataclass
class _Flags:
    kernel: bool = False  # a device is assumed writable until a sample says otherwise
    smart: bool = False


class NvmeReadonlyDetector:
    """Registered with all three NVMe collectors: one state per device for the three."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._flags: dict[str, _Flags] = {}
        self._latches = ConditionLatches(
            ConditionKind.NVME_READONLY, node, severity=Severity.CRITICAL, confirm=1, hold_s=0.0
        )

    def observe(self, sample: NvmeSample) -> list[EventBase]:
        seen: list[tuple[str, str, bool]]  # (device, source, read-only)
        match sample:
            case NvmeUdevSample(changes=changes):
                seen = [(c.device, "udev", c.readonly) for c in changes]
            case NvmeSmartSample(devices=logs):
                seen = [(dev, "smart", log.media_readonly) for dev, log in sorted(logs.items())]
            case NvmeLatencySample(devices=readings):
                seen = [(dev, "sysfs", r.readonly) for dev, r in sorted(readings.items())]
        events: list[EventBase] = []
        for dev, source, readonly in seen:
            event = self._update(dev, source, readonly, sample.time)
            if event is not None:
                events.append(event)
        return events

    def _update(self, dev: str, source: str, readonly: bool, t: float) -> EventBase | None:
        flags = self._flags.setdefault(dev, _Flags())
        if source == "smart":
            flags.smart = readonly
        else:
            flags.kernel = readonly
        latch = self._latches[dev]
        change = latch.update(flags.kernel or flags.smart, t)
        if change is None:
            return None
        now = change is Change.RAISED
        message = f"{dev} is {'read-only' if now else 'writable again'} ({WHY[source]})"
        return NvmeReadonly(
            severity=Severity.CRITICAL if now else Severity.INFO,
            node=self.node,
            device=dev,
            readonly=now,
            source=source,
            message=message,
            condition=latch.record(change, t, reason=message),
        )
