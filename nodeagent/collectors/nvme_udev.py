"""Block-device change uevents, live: the kernel announces ``DISK_RO=1`` when a disk turns
read-only, long before the next poll of ``/sys/block/<dev>/ro`` would see it.

The monitor's socket is exposed through :meth:`fileno`, so the sampling loop collects as
soon as a uevent arrives; each collection drains every pending uevent without blocking.
A change uevent that carries ``DISK_RO`` is taken at its word; any other change (a resize,
a rescan, ``echo change > uevent``) makes the collector re-read the device's ``ro`` file,
so a flag flipped without its own uevent is caught on the next event too.

Where udevd runs, its monitor (``source="udev"``) gets events after udev's rules ran; in
containers and on hosts without udevd it receives nothing, silently, so ``"auto"`` picks the
kernel's own netlink source there (udevd's control socket tells which).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import msgspec
import pyudev

from nodeagent.collectors.base import CollectorUnavailable, Roots, Sample
from nodeagent.collectors.nvme import WHOLE_DISK, StatError, parse_ro

UDEV_CONTROL = Path("/run/udev/control")


def pick_source(source: str, control: Path = UDEV_CONTROL) -> str:
    if source != "auto":
        return source
    return "udev" if control.exists() else "kernel"


class ReadonlyChange(msgspec.Struct, kw_only=True):
    """A disk's read-only state after one change uevent: as its ``DISK_RO`` said, or as its
    ``ro`` file read when the uevent did not say."""

    device: str
    readonly: bool
    via: Literal["DISK_RO", "ro"]


class NvmeUdevSample(Sample, kw_only=True):
    source: str  # "kernel" | "udev"
    changes: list[ReadonlyChange] = msgspec.field(default_factory=list)  # in arrival order
    errors: dict[str, str] = msgspec.field(default_factory=dict)


def change_of(
    action: str | None, name: str, properties: dict[str, str], block: Path
) -> ReadonlyChange | None:
    """What one uevent says about a disk's read-only state, or None if nothing."""
    if action != "change":
        return None
    flag = properties.get("DISK_RO")
    if flag in ("0", "1"):
        return ReadonlyChange(device=name, readonly=flag == "1", via="DISK_RO")
    readonly = parse_ro((block / name / "ro").read_text(encoding="ascii", errors="replace"))
    return ReadonlyChange(device=name, readonly=readonly, via="ro")


class NvmeUdevCollector:
    """Every pending change uevent of the watched block devices, drained without blocking."""

    name = "nvme_udev"

    def __init__(
        self,
        roots: Roots,
        *,
        source: str = "auto",
        devices: str = WHOLE_DISK.pattern,
        interval_s: float = 60.0,
    ) -> None:
        self.interval_s = interval_s  # the longest wait; uevents wake the collector sooner
        self.source = pick_source(source)
        self._block = roots.sysfs / "block"
        self._devices = re.compile(devices)
        self._monitor: pyudev.Monitor | None = None

    def fileno(self) -> int | None:
        """The monitor's socket once open: readable when uevents are pending."""
        return self._monitor.fileno() if self._monitor is not None else None

    def collect(self, now: float) -> NvmeUdevSample:
        if self._monitor is None:
            self._monitor = self._open()
        changes: list[ReadonlyChange] = []
        errors: dict[str, str] = {}
        while (device := self._monitor.poll(timeout=0)) is not None:
            name = device.sys_name
            if not self._devices.fullmatch(name):
                continue
            try:
                change = change_of(device.action, name, dict(device.properties), self._block)
            except (OSError, StatError) as exc:
                errors[name] = str(exc)
                continue
            if change is not None:
                changes.append(change)
        return NvmeUdevSample(time=now, source=self.source, changes=changes, errors=errors)

    def _open(self) -> pyudev.Monitor:
        try:
            monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=self.source)
            monitor.filter_by("block")
            monitor.start()
        except (OSError, ImportError, ValueError) as exc:
            raise CollectorUnavailable(f"no {self.source} uevent monitor: {exc}") from exc
        return monitor

    def close(self) -> None:
        self._monitor = None
