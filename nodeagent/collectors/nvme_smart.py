"""SMART health of each NVMe namespace's controller, polled with ``nvme smart-log``.

The controller sets ``critical_warning`` bits when it is failing: bit 0 spare capacity
below threshold, 1 temperature out of range, 2 reliability degraded, 3 media placed in
read-only mode, 4 volatile memory backup failed, 5 persistent memory region read-only.
Bit 3 means the next checkpoint write will fail, which is why it is watched even though the
kernel's read-only flag usually follows. Reading the log takes an admin command and a
process, so it is polled slowly (a minute by default).

The command is a setting with placeholders ``{dev}`` (the /dev root), ``{device}``
(``nvme0n1``) and ``{controller}`` (``nvme0``), so a simulated node can answer with a file.
"""

from __future__ import annotations

import json
import re
import subprocess

import msgspec

from nodeagent.collectors.base import CollectorUnavailable, Roots, Sample
from nodeagent.collectors.nvme import WHOLE_DISK

DEFAULT_COMMAND = ("nvme", "smart-log", "--output-format=json", "{dev}/{device}")
WARNINGS = {
    0x1: "spare_below_threshold",
    0x2: "temperature",
    0x4: "reliability_degraded",
    0x8: "media_readonly",
    0x10: "volatile_backup_failed",
    0x20: "pmr_readonly",
}
_CONTROLLER = re.compile(r"(nvme\d+)n\d+")


class SmartError(ValueError):
    """The command ran but its output is not a SMART log."""


class SmartLog(msgspec.Struct, kw_only=True):
    """The fields we use from one controller's SMART log."""

    critical_warning: int
    warnings: list[str]  # the names of critical_warning's bits that are set
    media_readonly: bool  # bit 3
    temperature_c: float | None = None
    avail_spare_pct: float | None = None
    percent_used: float | None = None


class NvmeSmartSample(Sample, kw_only=True):
    devices: dict[str, SmartLog] = msgspec.field(default_factory=dict)
    errors: dict[str, str] = msgspec.field(default_factory=dict)


def parse_smart(text: str) -> SmartLog:
    """The fields we use from ``nvme smart-log -o json``. ``critical_warning`` is a number
    in nvme-cli 1.x and 2.x, an object with a ``value`` in later verbose layouts."""
    try:
        log = json.loads(text)
        warning = log["critical_warning"]
        if isinstance(warning, dict):
            warning = warning["value"]
        warning = int(warning)
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise SmartError(f"not a SMART log: {exc!r} in {text.strip()[:80]!r}") from None
    kelvin = _number(log.get("temperature"))
    return SmartLog(
        critical_warning=warning,
        warnings=[name for bit, name in WARNINGS.items() if warning & bit],
        media_readonly=bool(warning & 0x8),
        temperature_c=round(kelvin - 273.15, 1) if kelvin is not None else None,
        avail_spare_pct=_number(log.get("avail_spare")),
        percent_used=_number(log.get("percent_used", log.get("percentage_used"))),
    )


def _number(value: object) -> float | None:
    """A numeric field of the log, or None when absent or not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int) and abs(value) > 2**64:  # no float arithmetic on it
        return None
    return value


class NvmeSmartCollector:
    """The SMART log of every NVMe namespace's controller; a device whose command fails or
    answers garbage is an entry in ``errors``, the others are read."""

    name = "nvme_smart"

    def __init__(
        self,
        roots: Roots,
        *,
        command: list[str] | None = None,
        interval_s: float = 60.0,
        timeout_s: float = 10.0,
    ) -> None:
        self.interval_s = interval_s
        self._roots = roots
        self._command = list(command or DEFAULT_COMMAND)
        self._timeout_s = timeout_s

    def collect(self, now: float) -> NvmeSmartSample:
        block = self._roots.sysfs / "block"
        try:
            names = sorted(p.name for p in block.iterdir() if WHOLE_DISK.fullmatch(p.name))
        except OSError as exc:
            raise CollectorUnavailable(f"cannot list {block}: {exc.strerror}") from exc
        if not names:
            raise CollectorUnavailable(f"no NVMe block devices under {block}")
        devices: dict[str, SmartLog] = {}
        errors: dict[str, str] = {}
        for dev in names:
            try:
                devices[dev] = parse_smart(self._run(dev))
            except (SmartError, subprocess.SubprocessError) as exc:
                errors[dev] = str(exc)
        return NvmeSmartSample(time=now, devices=devices, errors=errors)

    def _run(self, dev: str) -> str:
        fields = {"dev": str(self._roots.dev), "device": dev}
        fields["controller"] = match[1] if (match := _CONTROLLER.fullmatch(dev)) else dev
        argv = [part.format(**fields) for part in self._command]
        try:
            result = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=self._timeout_s,
                check=False,
            )
        except FileNotFoundError:
            raise CollectorUnavailable(f"no {argv[0]} command to read SMART logs") from None
        if result.returncode != 0:
            why = (result.stderr or result.stdout).strip()[:200]
            raise SmartError(f"{argv[0]} exited with {result.returncode}: {why}")
        return result.stdout
