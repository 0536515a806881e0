"""The fault language of ``coordinatorctl inject NODE FAULT`` (docs/signals.md): contract,
parsed into typed structs. Pure: no I/O.

Both sides read it from here: ``coordinatorctl`` parses a fault before sending it (and acts
on the process faults, ``PROCESS_FAULTS``, itself), and the hardware simulator
(``nodeagent.sim``) parses what it receives and applies it. Parsing covers every fault
form, even those the simulator cannot act on yet, so that a typo is refused with a clear
one-line message. ``str(fault)`` gives the canonical form, used to list active faults.
"""

from __future__ import annotations

import math
import re

import msgspec

from proto.net_faults import NET_FORMS, LinkDownFault, LinkUpFault, NetemFault, PartitionFault
from proto.net_faults import parse_net as _parse_net

DEVICE = re.compile(r"nvme\d+n\d+")
LINK_KINDS = ("PHB", "SYS", "NODE", "PIX", "PXB")  # besides NV<count>
_LINK = re.compile(r"(\d+)-(\d+):(NV[1-9]\d*|" + "|".join(LINK_KINDS) + r")")


class NvmeLatencyFault(msgspec.Struct, frozen=True):
    latency_us: float
    device: str | None = None  # None: every NVMe device of the node

    def __str__(self) -> str:
        return f"nvme-latency={self.latency_us:g}" + (f"@{self.device}" if self.device else "")


class NvmeReadonlyFault(msgspec.Struct, frozen=True):
    readonly: bool

    def __str__(self) -> str:
        return f"nvme-readonly={'on' if self.readonly else 'off'}"


class GpuTempFault(msgspec.Struct, frozen=True):
    temp_c: float
    gpu: int | None = None  # None: every GPU

    def __str__(self) -> str:
        return f"gpu-temp={self.temp_c:g}" + (f"@{self.gpu}" if self.gpu is not None else "")


class ClockOffsetFault(msgspec.Struct, frozen=True):
    offset_ms: float

    def __str__(self) -> str:
        return f"clock-offset={self.offset_ms:g}"


class SpotNoticeFault(msgspec.Struct, frozen=True):
    deadline_s: float  # seconds from injection to the preemption

    def __str__(self) -> str:
        return f"spot-notice={self.deadline_s:g}"


class PcieBwFault(msgspec.Struct, frozen=True):
    gbps: float
    gpu: int | None = None

    def __str__(self) -> str:
        return f"pcie-bw={self.gbps:g}" + (f"@{self.gpu}" if self.gpu is not None else "")


class LinkFault(msgspec.Struct, frozen=True):
    gpu_a: int
    gpu_b: int
    link: str  # NV<count> | PHB | SYS | NODE | PIX | PXB, as nvidia-smi topo prints it

    def __str__(self) -> str:
        return f"link={self.gpu_a}-{self.gpu_b}:{self.link}"


class KillWorkerFault(msgspec.Struct, frozen=True):
    def __str__(self) -> str:
        return "kill-worker"


class KillAgentFault(msgspec.Struct, frozen=True):
    def __str__(self) -> str:
        return "kill-agent"


class RestartAgentFault(msgspec.Struct, frozen=True):
    """The agent crashes and is started again as systemd's ``Restart=`` would: SIGKILL, then
    the same command line, environment and log; its ranks live on and are adopted."""

    def __str__(self) -> str:
        return "restart-agent"


class LoseNodeFault(msgspec.Struct, frozen=True):
    """The machine dies: its agent and every rank at once, no goodbye."""

    def __str__(self) -> str:
        return "lose-node"


class HangFault(msgspec.Struct, frozen=True):
    """A rank stops (SIGSTOP): nothing exits. ``rank`` None: the node's lowest rank."""

    rank: int | None = None

    def __str__(self) -> str:
        return "hang" + (f"={self.rank}" if self.rank is not None else "")


class SlowFault(msgspec.Struct, frozen=True):
    """The node's ranks compute ``factor`` times slower (a straggler); 1 is normal speed."""

    factor: float

    def __str__(self) -> str:
        return f"slow={self.factor:g}"


class NanLossFault(msgspec.Struct, frozen=True):
    """The next step's loss on the node's ranks is not finite."""

    def __str__(self) -> str:
        return "nan-loss"


class ClearFault(msgspec.Struct, frozen=True):
    def __str__(self) -> str:
        return "clear"


Fault = (
    NvmeLatencyFault
    | NvmeReadonlyFault
    | GpuTempFault
    | ClockOffsetFault
    | SpotNoticeFault
    | PcieBwFault
    | LinkFault
    | KillWorkerFault
    | KillAgentFault
    | RestartAgentFault
    | LoseNodeFault
    | HangFault
    | SlowFault
    | NanLossFault
    | ClearFault
    | LinkDownFault
    | LinkUpFault
    | NetemFault
    | PartitionFault
)

# Faults that act on the node's processes, not its simulated hardware: coordinatorctl
# carries them out itself, on the local cluster's files (see coordinator/ctl/inject.py).
PROCESS_FAULTS = (
    KillWorkerFault,
    KillAgentFault,
    RestartAgentFault,
    LoseNodeFault,
    HangFault,
    SlowFault,
    NanLossFault,
)


class SimKnobs(msgspec.Struct, kw_only=True):
    """What a simulated node's ranks read each step from ``$RINGMASTER_SIM_KNOBS``
    (``ringmaster.rundir.sim_knobs``): rehearsal-only knobs, ignored on real nodes.
    ``nan_loss`` counts requests: a rank makes one step's loss non-finite for each
    increase it sees."""

    slow: float = 1.0
    nan_loss: int = 0


# name → the form it expects, quoted in every error so the operator sees the fix.
FORMS = {
    "nvme-latency": "nvme-latency=<µs>[@nvmeXnY] with µs > 0",
    "nvme-readonly": "nvme-readonly=on|off",
    "gpu-temp": "gpu-temp=<°C>[@gpu] with 0 <= °C <= 150",
    "clock-offset": "clock-offset=<ms> (signed)",
    "spot-notice": "spot-notice=<s> with s >= 0",
    "pcie-bw": "pcie-bw=<GB/s>[@gpu] with GB/s >= 0",
    "link": "link=<gpuA>-<gpuB>:<NV#|PHB|SYS|NODE|PIX|PXB> with gpuA != gpuB",
    "kill-worker": "kill-worker",
    "kill-agent": "kill-agent",
    "restart-agent": "restart-agent",
    "lose-node": "lose-node",
    "hang": "hang[=<rank>]",
    "slow": "slow=<factor> with 1 <= factor <= 1000",
    "nan-loss": "nan-loss",
    "clear": "clear",
} | NET_FORMS  # on namespaced nodes only (proto.net_faults)
_BARE: dict[
    str,
    type[
        KillWorkerFault
        | KillAgentFault
        | RestartAgentFault
        | LoseNodeFault
        | NanLossFault
        | ClearFault
    ],
] = {
    "kill-worker": KillWorkerFault,
    "kill-agent": KillAgentFault,
    "restart-agent": RestartAgentFault,
    "lose-node": LoseNodeFault,
    "nan-loss": NanLossFault,
    "clear": ClearFault,
}


class _Bad(Exception):
    """Raised inside a parser; turned into one ValueError naming the fault and its form."""


def parse_fault(text: str) -> Fault:
    """One fault from its command-line form; ValueError names the fault and what it expects."""
    name, sep, value = text.strip().partition("=")
    if name not in FORMS:
        raise ValueError(f"unknown fault {name!r}; expected one of: {', '.join(FORMS)}")
    try:
        if name in _BARE:
            if sep:
                raise _Bad("takes no value")
            return _BARE[name]()
        if name == "hang":
            if not sep:
                return HangFault()
            if not (value.isascii() and value.isdigit()) or len(value) > 9:
                raise _Bad(f"rank {value!r} is not a rank number")
            return HangFault(rank=int(value))
        if not value:
            raise _Bad("missing value")
        if name in NET_FORMS:
            try:
                return _parse_net(name, value)
            except ValueError as exc:
                raise _Bad(str(exc)) from None
        return _parse_valued(name, value)
    except _Bad as exc:
        raise ValueError(f"bad fault {text.strip()!r}: {exc}; expected {FORMS[name]}") from None


def _parse_valued(name: str, value: str) -> Fault:
    if name == "nvme-readonly":
        if value not in ("on", "off"):
            raise _Bad(f"{value!r} is not on or off")
        return NvmeReadonlyFault(readonly=value == "on")
    if name == "link":
        match = _LINK.fullmatch(value)
        if not match or match[1] == match[2] or max(len(match[1]), len(match[2])) > 9:
            raise _Bad(f"{value!r} is not a link between two GPUs")
        return LinkFault(gpu_a=int(match[1]), gpu_b=int(match[2]), link=match[3])
    if name == "clock-offset":
        return ClockOffsetFault(offset_ms=_number(value))
    if name == "spot-notice":
        return SpotNoticeFault(deadline_s=_number(value, low=0.0))
    if name == "slow":
        return SlowFault(factor=_number(value, low=1.0, high=1000.0))
    number, at, target = value.partition("@")
    if at and not target:
        raise _Bad("nothing after '@'")
    if name == "nvme-latency":
        if target and not DEVICE.fullmatch(target):
            raise _Bad(f"{target!r} is not an NVMe namespace like nvme0n1")
        latency = _number(number, low=0.0)
        if latency == 0:
            raise _Bad("latency must be above 0")
        return NvmeLatencyFault(latency_us=latency, device=target or None)
    gpu = _gpu(target) if target else None
    if name == "gpu-temp":
        return GpuTempFault(temp_c=_number(number, low=0.0, high=150.0), gpu=gpu)
    return PcieBwFault(gbps=_number(number, low=0.0), gpu=gpu)


def _number(text: str, *, low: float = -math.inf, high: float = math.inf) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _Bad(f"{text!r} is not a number") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise _Bad(f"{text.strip()} is out of range")
    return value


def _gpu(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 9:
        raise _Bad(f"GPU {text!r} is not an index")
    return int(text)
