"""NvmeLatencyCollector against real files: fixture trees, this machine's /sys, bad devices."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from nodeagent.collectors.base import CollectorUnavailable, Roots
from nodeagent.collectors.nvme import (
    WHOLE_DISK,
    NvmeDeviceReading,
    NvmeLatencyCollector,
    parse_stat,
)

Tree = Callable[[str], Path]


def collector(root: Path, devices: list[str] | None = None) -> NvmeLatencyCollector:
    return NvmeLatencyCollector(Roots(sysfs=root / "sys"), devices)


def write_stat(
    root: Path, dev: str, reads: int, read_ms: int, writes: int, write_ms: int, in_flight: int = 0
) -> None:
    fields = [reads, 0, reads * 8, read_ms, writes, 0, writes * 8, write_ms, in_flight, 0, 0]
    (root / "sys" / "block" / dev / "stat").write_text(" ".join(map(str, fields)) + "\n")


def test_latency_iops_and_readonly_over_a_window(tree: Tree) -> None:
    root = tree("sysfs_nvme")
    nvme = collector(root)
    first = nvme.collect(100.0)
    assert first.time == 100.0 and first.errors == {}
    assert first.devices == {
        "nvme0n1": NvmeDeviceReading(readonly=False, in_flight=0),
        "nvme1n1": NvmeDeviceReading(readonly=False, in_flight=2),
    }
    tree("sysfs_nvme_t1")
    devices = nvme.collect(100.5).devices
    assert devices["nvme0n1"].latency_us == pytest.approx(50_000 / 2400)
    assert devices["nvme0n1"].iops == pytest.approx(4800)
    assert devices["nvme1n1"] == NvmeDeviceReading(
        latency_us=500.0, iops=4000.0, readonly=True, in_flight=3
    )


def test_only_whole_nvme_disks_are_read(tree: Tree) -> None:
    """Partitions and multipath path devices (nvme0c0n1) would double-count; vda, loop and
    zram from this machine's real /sys snapshot are not NVMe."""
    root = tree("sysfs_this_machine")
    tree("sysfs_nvme")
    assert sorted(collector(root).collect(0.0).devices) == ["nvme0n1", "nvme1n1"]


def test_device_filter(tree: Tree) -> None:
    root = tree("sysfs_nvme")
    sample = collector(root, ["nvme1n1", "nvme9n1"]).collect(0.0)
    assert list(sample.devices) == ["nvme1n1"]
    assert sample.errors == {"nvme9n1": "device not present"}


def test_no_nvme_on_this_machines_snapshot_is_unavailable(tree: Tree) -> None:
    root = tree("sysfs_this_machine")
    with pytest.raises(CollectorUnavailable, match=f"no NVMe block devices under {root}/sys/block"):
        collector(root).collect(0.0)


def test_missing_sysfs_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(CollectorUnavailable, match="cannot list"):
        collector(tmp_path).collect(0.0)


def test_the_real_kernel() -> None:
    """This machine's NVMe devices, compared with their sysfs files read independently."""
    block = Path("/sys/block")
    present = sorted(p.name for p in block.iterdir() if WHOLE_DISK.fullmatch(p.name))
    if not present:
        pytest.skip("this host has no NVMe block device (the fixture trees cover the reads)")
    nvme = NvmeLatencyCollector(Roots())
    nvme.collect(0.0)
    sample = nvme.collect(0.5)
    assert sample.errors == {} and sorted(sample.devices) == present
    for dev, reading in sample.devices.items():
        assert reading.readonly == ((block / dev / "ro").read_text().strip() == "1")


def test_each_bad_device_is_an_error_and_the_rest_are_read(tree: Tree) -> None:
    root = tree("sysfs_edge")
    nvme = collector(root)
    nvme.collect(0.0)
    write_stat(root, "nvme0n1", 1100, 22, 600, 11)  # +200 I/Os, +3 ms
    write_stat(root, "nvme7n1", 1100, 22, 500, 10)  # +100 I/Os, +2 ms
    sample = nvme.collect(0.5)
    assert sample.devices == {
        "nvme0n1": NvmeDeviceReading(latency_us=15.0, iops=400.0, readonly=False, in_flight=0),
        "nvme7n1": NvmeDeviceReading(latency_us=20.0, iops=200.0, readonly=False, in_flight=0),
    }
    errors = sample.errors
    assert sorted(errors) == ["nvme1n1", "nvme2n1", "nvme3n1", "nvme4n1", "nvme5n1", "nvme6n1"]
    assert "non-integer field" in errors["nvme1n1"]
    assert errors["nvme2n1"] == "expected 11, 15 or 17 fields, got 7"
    assert errors["nvme3n1"] == f"Is a directory: {root}/sys/block/nvme3n1/stat"
    assert errors["nvme4n1"].startswith("vanished while reading:")
    assert errors["nvme5n1"] == "ro holds 'yes', expected 0 or 1"
    assert errors["nvme6n1"] == "expected 11, 15 or 17 fields, got 16"


def test_longer_lines_of_later_kernels_are_accepted() -> None:
    assert parse_stat(" ".join(["1"] * 11 + ["0"] * 9)) == (2, 2, 1)


def test_counters_going_backwards_rebaseline(tree: Tree) -> None:
    """A wrap (32-bit counters) or a controller reset: no latency for that window, then the
    next window is measured from the new values."""
    root = tree("sysfs_edge")
    nvme = collector(root, ["nvme0n1"])
    nvme.collect(0.0)
    write_stat(root, "nvme0n1", 40, 1, 10, 0)
    assert nvme.collect(0.5).devices["nvme0n1"].latency_us is None
    write_stat(root, "nvme0n1", 140, 3, 10, 0)
    assert nvme.collect(1.0).devices["nvme0n1"].latency_us == 20.0


def test_ticks_going_backwards_alone_also_rebaselines(tree: Tree) -> None:
    root = tree("sysfs_edge")
    nvme = collector(root, ["nvme0n1"])
    nvme.collect(0.0)
    write_stat(root, "nvme0n1", 1100, 0, 500, 0)
    device = nvme.collect(0.5).devices["nvme0n1"]
    assert (device.latency_us, device.iops, device.idle) == (None, 0.0, False)


def test_no_io_and_nothing_in_flight_is_idle(tree: Tree) -> None:
    root = tree("sysfs_nvme")
    nvme = collector(root)
    nvme.collect(0.0)
    device = nvme.collect(0.5).devices["nvme0n1"]
    assert device == NvmeDeviceReading(readonly=False, in_flight=0, idle=True)


def test_io_in_flight_and_none_completing_is_a_stall(tree: Tree) -> None:
    """I/Os in flight at both ends of a window without completions: one has waited the whole
    window, so latency is at least the window (a hung controller never completes any)."""
    root = tree("sysfs_nvme")
    nvme = collector(root, ["nvme1n1"])
    nvme.collect(10.0)  # 2 in flight
    device = nvme.collect(10.5).devices["nvme1n1"]
    assert device.stalled and not device.idle
    assert device.latency_us == pytest.approx(500_000.0)
    write_stat(root, "nvme1n1", 9876543, 197530, 1234567, 24691, in_flight=0)
    drained = nvme.collect(11.0).devices["nvme1n1"]
    assert drained.latency_us is None and drained.idle and not drained.stalled
    write_stat(root, "nvme1n1", 9876543, 197530, 1234567, 24691, in_flight=4)
    assert not nvme.collect(11.5).devices["nvme1n1"].stalled, "just submitted"


def test_device_vanishes_then_appears(tree: Tree) -> None:
    root = tree("sysfs_nvme")
    nvme = collector(root)
    nvme.collect(0.0)
    (root / "sys" / "block" / "nvme1n1").unlink()
    sample = nvme.collect(0.5)
    assert list(sample.devices) == ["nvme0n1"]
    assert sample.errors == {"nvme1n1": "device vanished"}
    assert nvme.collect(1.0).errors == {}, "a vanished device is reported once"

    tree("sysfs_nvme")  # hot-plugged back, with counters that moved on meanwhile
    tree("sysfs_nvme_t1")
    back = nvme.collect(1.5).devices["nvme1n1"]
    assert back.latency_us is None, "a device that appears is baselined first"
    write_stat(root, "nvme1n1", 9880043, 198380, 1235067, 24941)
    assert nvme.collect(2.0).devices["nvme1n1"].latency_us == 50.0


def test_unreadable_stat_file_is_an_error(tree: Tree) -> None:
    """chmod 000 as on a node. Root ignores file modes, so the collector runs in a forked
    child that drops to user nobody and reads the tree by a path relative to its working dir
    (pytest's tmp dirs above it are private to root)."""
    root = tree("sysfs_nvme")
    (root / "sys" / "block" / "nvme1n1" / "stat").chmod(0)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        status = 1
        try:
            os.chdir(root)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            sample = NvmeLatencyCollector(Roots(sysfs=Path("sys"))).collect(0.0)
            os.write(write_end, msgspec.json.encode(sample))
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        output = pipe.read()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    values = json.loads(output)
    assert list(values["devices"]) == ["nvme0n1"]
    assert values["errors"] == {"nvme1n1": "Permission denied: sys/block/nvme1n1/stat"}
