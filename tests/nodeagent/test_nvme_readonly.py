"""NvmeReadonlyDetector: the kernel flag (sysfs poll, udev) and SMART merged, one event a
change, carrying the source that caused it."""

from __future__ import annotations

from typing import Any

from nodeagent.collectors.base import Sample
from nodeagent.detectors.nvme_readonly import NvmeReadonlyDetector
from proto.events import NvmeReadonly


def sysfs(t: float, **ro: bool) -> Sample:
    return Sample(
        collector="nvme", time=t, values={"devices": {d: {"readonly": r} for d, r in ro.items()}}
    )


def udev(t: float, *changes: tuple[str, bool]) -> Sample:
    values = {"changes": [{"device": d, "readonly": r, "from": "DISK_RO"} for d, r in changes]}
    return Sample(collector="nvme_udev", time=t, values=values)


def smart(t: float, **ro: bool) -> Sample:
    devices = {d: {"media_readonly": r, "critical_warning": 8 if r else 0} for d, r in ro.items()}
    return Sample(collector="nvme_smart", time=t, values={"devices": devices})


def flips(detector: NvmeReadonlyDetector, *samples: Sample) -> list[tuple[Any, ...]]:
    events = [e for s in samples for e in detector.observe(s)]
    assert all(isinstance(e, NvmeReadonly) for e in events)
    return [
        (e.device, e.readonly, e.source, e.severity) for e in events if isinstance(e, NvmeReadonly)
    ]


def test_udev_first_then_the_poll_agrees() -> None:
    detector = NvmeReadonlyDetector("node-1")
    assert flips(
        detector,
        sysfs(0, nvme0n1=False, nvme1n1=False),
        udev(0.2, ("nvme1n1", True)),
        sysfs(0.5, nvme0n1=False, nvme1n1=True),
        sysfs(1.0, nvme0n1=False, nvme1n1=False),
        udev(1.1, ("nvme1n1", False)),
    ) == [("nvme1n1", True, "udev", "critical"), ("nvme1n1", False, "sysfs", "info")]


def test_smart_alone_makes_a_device_readonly_until_it_clears() -> None:
    detector = NvmeReadonlyDetector("n")
    assert flips(
        detector,
        sysfs(0, nvme0n1=False),
        smart(1, nvme0n1=True),
        sysfs(2, nvme0n1=True),
        sysfs(3, nvme0n1=False),
        smart(4, nvme0n1=False),
    ) == [("nvme0n1", True, "smart", "critical"), ("nvme0n1", False, "smart", "info")]


def test_readonly_at_first_sight_is_reported() -> None:
    """A node that boots with its disk already write-protected is as broken as one whose
    disk flips later."""
    event = NvmeReadonlyDetector("n").observe(sysfs(0, nvme0n1=True))[0]
    assert isinstance(event, NvmeReadonly) and event.node == "n"
    assert event.message == "nvme0n1 is read-only (the kernel's ro flag)"


def test_devices_are_independent() -> None:
    detector = NvmeReadonlyDetector("n")
    assert flips(detector, udev(0, ("nvme0n1", True), ("nvme1n1", False))) == [
        ("nvme0n1", True, "udev", "critical")
    ]
