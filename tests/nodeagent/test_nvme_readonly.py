"""NvmeReadonlyDetector: the kernel flag (sysfs poll, udev) and SMART merged, one event a
change, carrying the source that caused it and the device's one ``nvme.readonly``
condition."""

from __future__ import annotations

from typing import Any

from nodeagent.collectors.nvme import NvmeDeviceReading, NvmeLatencySample
from nodeagent.collectors.nvme_smart import NvmeSmartSample, SmartLog
from nodeagent.collectors.nvme_udev import NvmeUdevSample, ReadonlyChange
from nodeagent.detectors.nvme_readonly import NvmeReadonlyDetector, NvmeSample
from proto.conditions import ConditionKind, condition_key
from proto.events import NvmeReadonly


def sysfs(t: float, **ro: bool) -> NvmeLatencySample:
    devices = {d: NvmeDeviceReading(readonly=r, in_flight=0) for d, r in ro.items()}
    return NvmeLatencySample(time=t, devices=devices)


def udev(t: float, *changes: tuple[str, bool]) -> NvmeUdevSample:
    seen = [ReadonlyChange(device=d, readonly=r, via="DISK_RO") for d, r in changes]
    return NvmeUdevSample(time=t, source="kernel", changes=seen)


def smart(t: float, **ro: bool) -> NvmeSmartSample:
    devices = {
        d: SmartLog(
            critical_warning=8 if r else 0,
            warnings=["media_readonly"] if r else [],
            media_readonly=r,
        )
        for d, r in ro.items()
    }
    return NvmeSmartSample(time=t, devices=devices)


def events(detector: NvmeReadonlyDetector, *samples: NvmeSample) -> list[NvmeReadonly]:
    out = [e for s in samples for e in detector.observe(s)]
    assert all(isinstance(e, NvmeReadonly) for e in out)
    return [e for e in out if isinstance(e, NvmeReadonly)]


def flips(detector: NvmeReadonlyDetector, *samples: NvmeSample) -> list[tuple[Any, ...]]:
    return [(e.device, e.readonly, e.source, e.severity) for e in events(detector, *samples)]


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


def test_one_condition_per_device_whichever_source_saw_it() -> None:
    detector = NvmeReadonlyDetector("node-1")
    seen = events(
        detector,
        smart(1, nvme0n1=True),
        udev(1.5, ("nvme0n1", True)),
        sysfs(2, nvme0n1=True),
        smart(3, nvme0n1=False),
        sysfs(4, nvme0n1=False),
    )
    conditions = [e.condition for e in seen]
    key = condition_key(ConditionKind.NVME_READONLY, "node-1", "nvme0n1")
    assert [(c.key, c.active, c.since) for c in conditions if c] == [
        (key, True, 1),
        (key, False, 4),
    ]
    assert all(c is not None and c.severity == "critical" for c in conditions)
    assert conditions[0] is not None and conditions[0].reason == "nvme0n1 is read-only (SMART)"


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
