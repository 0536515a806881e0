"""NvmeSmartCollector running real commands: a stand-in ``nvme`` on PATH, ``cat`` of
captured nvme-cli JSON, failures, timeouts and garbage."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from nodeagent.collectors.base import CollectorUnavailable, Roots
from nodeagent.collectors.nvme_smart import NvmeSmartCollector, SmartError, SmartLog, parse_smart

SMART = Path(__file__).resolve().parent.parent / "fixtures" / "smart"
Tree = Callable[[str], Path]

FAKE_NVME = """#!/bin/sh
# Answers like nvme-cli for the devices whose logs lie next to it; refuses other usage.
[ "$1" = smart-log ] && [ "$2" = --output-format=json ] || { echo "usage" >&2; exit 2; }
log="$(dirname "$0")/$(basename "$3").json"
[ -f "$log" ] || { echo "$3: No such file or directory" >&2; exit 1; }
echo "$3" >> "$(dirname "$0")/calls"
cat "$log"
"""


def fake_nvme(directory: Path, logs: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvme"
    script.write_text(FAKE_NVME)
    script.chmod(0o755)
    for device, fixture in logs.items():
        shutil.copy(SMART / f"{fixture}.json", directory / f"{device}.json")
    return script


def test_default_command_through_a_stand_in_nvme(
    tree: Tree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tree("sysfs_nvme")
    bin_dir = tmp_path / "bin"
    fake_nvme(bin_dir, {"nvme0n1": "healthy", "nvme1n1": "readonly"})
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    sample = NvmeSmartCollector(Roots(sysfs=root / "sys", dev=Path("/dev"))).collect(5.0)
    assert sample.time == 5.0 and sample.errors == {}
    assert sample.devices == {
        "nvme0n1": SmartLog(
            critical_warning=0,
            warnings=[],
            media_readonly=False,
            temperature_c=36.9,
            avail_spare_pct=100,
            percent_used=3,
        ),
        "nvme1n1": SmartLog(
            critical_warning=12,
            warnings=["reliability_degraded", "media_readonly"],
            media_readonly=True,
            temperature_c=51.9,
            avail_spare_pct=4,
            percent_used=104,
        ),
    }
    assert (bin_dir / "calls").read_text() == "/dev/nvme0n1\n/dev/nvme1n1\n"


def test_command_placeholders_and_one_failing_device(tree: Tree, tmp_path: Path) -> None:
    root = tree("sysfs_nvme")
    (tmp_path / "nvme0.json").write_text((SMART / "verbose.json").read_text())
    collector = NvmeSmartCollector(
        Roots(sysfs=root / "sys"), command=["cat", f"{tmp_path}/{{controller}}.json"]
    )
    sample = collector.collect(0.0)
    assert sample.devices["nvme0n1"].media_readonly is True
    assert sample.devices["nvme0n1"].warnings == ["media_readonly"]
    assert list(sample.errors) == ["nvme1n1"]
    assert sample.errors["nvme1n1"].startswith("cat exited with 1: cat: ")


def test_missing_command_is_unavailable(tree: Tree) -> None:
    root = tree("sysfs_nvme")
    collector = NvmeSmartCollector(Roots(sysfs=root / "sys"), command=["no-such-nvme-cli"])
    with pytest.raises(CollectorUnavailable, match="no no-such-nvme-cli command"):
        collector.collect(0.0)


def test_no_nvme_devices_is_unavailable(tree: Tree) -> None:
    root = tree("sysfs_this_machine")
    with pytest.raises(CollectorUnavailable, match="no NVMe block devices"):
        NvmeSmartCollector(Roots(sysfs=root / "sys")).collect(0.0)


def test_a_hung_command_times_out(tree: Tree) -> None:
    root = tree("sysfs_nvme")
    collector = NvmeSmartCollector(Roots(sysfs=root / "sys"), command=["sleep", "5"], timeout_s=0.2)
    errors = collector.collect(0.0).errors
    assert errors["nvme0n1"] == "Command '['sleep', '5']' timed out after 0.2 seconds"


@pytest.mark.parametrize(
    "text",
    ["", "not json", "[]", '{"temperature": 300}', '{"critical_warning": "high"}'],
)
def test_garbage_is_an_error(text: str) -> None:
    with pytest.raises(SmartError, match="not a SMART log"):
        parse_smart(text)
