"""RDMA ports from ``<sysfs>/class/infiniband/<dev>/ports/<n>/``: logical and physical state,
and the error counters of the port.

On a GPU cluster NCCL usually moves the collectives over these ports rather than over the
interface of the default route, so a port that leaves ACTIVE/LinkUp stalls the jobs using
it. The kernel writes ``state`` as ``"4: ACTIVE"`` and ``phys_state`` as ``"5: LinkUp"``
(number, then name); the name is kept. ``counters/`` are read where the driver provides
them (RoCE ports lack some).

A port whose files are missing or garbled becomes a one-line entry in ``errors`` keyed
``dev/port``; a machine without ``class/infiniband`` (no RDMA driver loaded) raises
:class:`CollectorUnavailable`.
"""

from __future__ import annotations

import os
import re

import msgspec

from nodeagent.collectors.base import CollectorUnavailable, Roots, Sample
from nodeagent.collectors.nic import NicError, counter, describe
from nodeagent.collectors.nvme import read_small

COUNTERS = ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors")
_STATE = re.compile(r"(\d+): ?([A-Za-z_]+)")


class RdmaPortReading(msgspec.Struct, kw_only=True):
    state: str  # ACTIVE, DOWN, INIT, ARMED, ACTIVE_DEFER
    phys_state: str  # LinkUp, Polling, Disabled, ...
    counters: dict[str, int] = msgspec.field(default_factory=dict)  # those present

    @property
    def up(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state == "LinkUp"


class RdmaSample(Sample, kw_only=True):
    ports: dict[str, RdmaPortReading] = msgspec.field(default_factory=dict)  # "mlx5_0/1"
    errors: dict[str, str] = msgspec.field(default_factory=dict)


class RdmaCollector:
    name = "rdma"

    def __init__(self, roots: Roots, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._ib = roots.sysfs / "class" / "infiniband"

    def collect(self, now: float) -> RdmaSample:
        try:
            devices = sorted(os.listdir(self._ib))  # noqa: PTH208
        except OSError as exc:
            raise CollectorUnavailable(f"no RDMA devices: {exc.strerror}: {self._ib}") from exc
        if not devices:
            raise CollectorUnavailable(f"no RDMA devices under {self._ib}")
        ports: dict[str, RdmaPortReading] = {}
        errors: dict[str, str] = {}
        for dev in devices:
            try:
                numbers = sorted(os.listdir(f"{self._ib}/{dev}/ports"), key=_numeric)  # noqa: PTH208
            except OSError as exc:
                errors[dev] = describe(exc)
                continue
            for number in numbers:
                try:
                    ports[f"{dev}/{number}"] = self._read(f"{self._ib}/{dev}/ports/{number}")
                except (OSError, NicError) as exc:
                    errors[f"{dev}/{number}"] = describe(exc)
        return RdmaSample(time=now, ports=ports, errors=errors)

    def _read(self, base: str) -> RdmaPortReading:
        counters = {
            name: counter(f"{base}/counters/{name}")
            for name in COUNTERS
            if os.path.exists(f"{base}/counters/{name}")  # noqa: PTH110
        }
        return RdmaPortReading(
            state=parse_state(read_small(f"{base}/state"), "state"),
            phys_state=parse_state(read_small(f"{base}/phys_state"), "phys_state"),
            counters=counters,
        )


def parse_state(text: str, what: str) -> str:
    """``"4: ACTIVE"`` → ``"ACTIVE"``."""
    match = _STATE.fullmatch(text.strip())
    if match is None:
        raise NicError(f"{what} holds {text.strip()[:30]!r}, expected 'N: NAME'")
    return match.group(2)


def _numeric(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)
