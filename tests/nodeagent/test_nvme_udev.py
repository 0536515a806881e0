"""NvmeUdevCollector against this machine's kernel: real change uevents on a loop device
(``blockdev --setro`` flips its read-only flag, ``echo change > uevent`` announces it), and
the decoding of DISK_RO uevents."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.collectors.base import Roots
from nodeagent.collectors.nvme import StatError
from nodeagent.collectors.nvme_udev import (
    NvmeUdevCollector,
    ReadonlyChange,
    change_of,
    pick_source,
)
from nodeagent.sampling import pause
from ringmaster.clock import EPOCH

BLOCK = Path("/sys/block")
HOUR_S = 3600.0  # a pause that only news can end within a test's time


def free_loop_device() -> str | None:
    """An unattached loop device (size 0) that is writable now, highest number first."""
    for path in sorted(BLOCK.glob("loop*"), key=lambda p: int(p.name[4:]), reverse=True):
        if (path / "size").read_text().strip() == "0" and (path / "ro").read_text() == "0\n":
            return path.name
    return None


@pytest.fixture
def loop_device() -> Iterator[str]:
    if os.geteuid() != 0 or shutil.which("blockdev") is None:
        pytest.skip("needs root and blockdev to flip a loop device's read-only flag")
    name = free_loop_device()
    if name is None or not Path(f"/dev/{name}").exists():
        pytest.skip("no free loop device with a /dev node")
    try:
        yield name
    finally:
        subprocess.run(["blockdev", "--setrw", f"/dev/{name}"], check=False)


def flip(name: str, readonly: bool) -> None:
    flag = "--setro" if readonly else "--setrw"
    subprocess.run(["blockdev", flag, f"/dev/{name}"], check=True)
    (BLOCK / name / "uevent").write_text("change")


def changes_for(collector: NvmeUdevCollector, name: str) -> list[ReadonlyChange]:
    sample = collector.collect(EPOCH)
    assert sample.source == "kernel" and sample.errors == {}
    return [c for c in sample.changes if c.device == name]


def test_real_change_uevents_wake_the_collector(loop_device: str) -> None:
    collector = NvmeUdevCollector(Roots(), source="kernel", devices=r"loop\d+")
    assert collector.fileno() is None, "no monitor before the first collection"
    assert changes_for(collector, loop_device) == []
    fd = collector.fileno()
    assert fd is not None

    async def woken_after_flip(readonly: bool) -> None:
        waiting = asyncio.create_task(pause(collector, HOUR_S))
        await asyncio.sleep(0)  # the pause is waiting on the monitor
        assert not waiting.done()
        flip(loop_device, readonly)
        try:
            await asyncio.wait_for(waiting, 30)
        except TimeoutError:
            raise AssertionError("the uevent did not end the pause") from None

    asyncio.run(woken_after_flip(True))  # a uevent ends the pause at once
    assert changes_for(collector, loop_device) == [
        ReadonlyChange(device=loop_device, readonly=True, via="ro")
    ]
    asyncio.run(woken_after_flip(False))
    assert changes_for(collector, loop_device) == [
        ReadonlyChange(device=loop_device, readonly=False, via="ro")
    ]
    collector.close()


def test_disk_ro_is_taken_at_its_word(tmp_path: Path) -> None:
    """The kernel's set_disk_ro() sends DISK_RO=1/0 with the change; no file is read."""
    assert change_of("change", "nvme0n1", {"DISK_RO": "1"}, tmp_path) == ReadonlyChange(
        device="nvme0n1", readonly=True, via="DISK_RO"
    )
    cleared = change_of("change", "nvme0n1", {"DISK_RO": "0"}, tmp_path)
    assert cleared is not None and cleared.readonly is False
    for action in ("add", "remove", "bind", None):
        assert change_of(action, "nvme0n1", {"DISK_RO": "1"}, tmp_path) is None


def test_other_changes_read_the_ro_file(tmp_path: Path) -> None:
    (tmp_path / "nvme1n1").mkdir()
    (tmp_path / "nvme1n1" / "ro").write_text("1\n")
    assert change_of("change", "nvme1n1", {"DISK_RO": "x"}, tmp_path) == ReadonlyChange(
        device="nvme1n1", readonly=True, via="ro"
    )
    (tmp_path / "nvme1n1" / "ro").write_text("maybe\n")
    with pytest.raises(StatError):
        change_of("change", "nvme1n1", {}, tmp_path)
    with pytest.raises(FileNotFoundError):
        change_of("change", "nvme2n1", {}, tmp_path)


def test_source_follows_udevd(tmp_path: Path) -> None:
    control = tmp_path / "control"
    assert pick_source("auto", control) == "kernel"
    control.touch()
    assert pick_source("auto", control) == "udev"
    assert pick_source("kernel", control) == "kernel"
