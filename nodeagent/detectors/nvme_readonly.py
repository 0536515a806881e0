"""``nvme.readonly`` from three sources that see the same fault at different speeds.

The kernel's read-only flag of a disk is polled in ``/sys/block/<dev>/ro`` (``nvme``
samples) and announced at once by a ``DISK_RO`` change uevent (``nvme_udev`` samples); the
controller's own verdict is bit 3 of the SMART critical warning (``nvme_smart`` samples),
which can be set before the kernel notices. A device is read-only while either the kernel
flag or the SMART bit says so; one event marks each change, carrying the source that caused
it, so the three sources never produce three events for one fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nodeagent.collectors.base import Sample
from proto.events import EventBase, NvmeReadonly, Severity


@dataclass
class _Device:
    kernel: bool = False  # a device is assumed writable until a sample says otherwise
    smart: bool = False
    reported: bool = False


class NvmeReadonlyDetector:
    """Registered with all three collectors; ``collector`` names the first."""

    collector = "nvme"

    def __init__(self, node: str) -> None:
        self.node = node
        self._devices: dict[str, _Device] = {}

    def observe(self, sample: Sample) -> list[EventBase]:
        events: list[EventBase] = []
        if sample.collector == "nvme_udev":
            for change in sample.values.get("changes", []):
                events += self._update(change["device"], "udev", bool(change["readonly"]))
            return events
        devices: dict[str, dict[str, Any]] = sample.values.get("devices", {})
        for dev, reading in sorted(devices.items()):
            if sample.collector == "nvme_smart":
                events += self._update(dev, "smart", bool(reading["media_readonly"]))
            else:
                events += self._update(dev, "sysfs", bool(reading["readonly"]))
        return events

    def _update(self, dev: str, source: str, readonly: bool) -> list[EventBase]:
        state = self._devices.setdefault(dev, _Device())
        if source == "smart":
            state.smart = readonly
        else:
            state.kernel = readonly
        now = state.kernel or state.smart
        if now == state.reported:
            return []
        state.reported = now
        why = {"sysfs": "the kernel's ro flag", "udev": "a DISK_RO uevent", "smart": "SMART"}
        return [
            NvmeReadonly(
                severity=Severity.CRITICAL if now else Severity.INFO,
                node=self.node,
                device=dev,
                readonly=now,
                source=source,
                message=f"{dev} is {'read-only' if now else 'writable again'} ({why[source]})",
            )
        ]
