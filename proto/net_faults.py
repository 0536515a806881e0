"""The network faults of ``coordinatorctl inject``, for nodes of ``up --netns`` only: a
link of the node's down or up again, netem on a link, a partition between two nodes'
data addresses. Parsed here, pure, like the rest of the fault language
(``proto.faults``, which takes them into its union); carried out by
``coordinator.ctl.netns_faults``.
"""

from __future__ import annotations

import math
import re
from typing import Literal

import msgspec

from proto.subjects import check_token

Link = Literal["data", "ctl"]
LINKS: tuple[Link, ...] = ("data", "ctl")
_NETEM = re.compile(r"(loss)=([0-9.]+)%|(delay)=([0-9.]+)ms")


class LinkDownFault(msgspec.Struct, frozen=True):
    """The node's veth on that network loses its carrier: its host side goes down, as a
    pulled cable or a dead switch port would."""

    link: Link

    def __str__(self) -> str:
        return f"link-down={self.link}"


class LinkUpFault(msgspec.Struct, frozen=True):
    link: Link

    def __str__(self) -> str:
        return f"link-up={self.link}"


class NetemFault(msgspec.Struct, frozen=True):
    """Loss and delay on what the node sends on that link (``tc qdisc ... netem``)."""

    link: Link
    loss_pct: float | None = None
    delay_ms: float | None = None

    def __str__(self) -> str:
        opts = ([f"loss={self.loss_pct:g}%"] if self.loss_pct is not None else []) + (
            [f"delay={self.delay_ms:g}ms"] if self.delay_ms is not None else []
        )
        return f"netem={self.link}:{','.join(opts)}"


class PartitionFault(msgspec.Struct, frozen=True):
    """No traffic between this node's data address and ``peer``'s, either way."""

    peer: str

    def __str__(self) -> str:
        return f"partition={self.peer}"


NetFault = LinkDownFault | LinkUpFault | NetemFault | PartitionFault
NET_FAULTS = (LinkDownFault, LinkUpFault, NetemFault, PartitionFault)

NET_FORMS = {
    "link-down": "link-down=data|ctl",
    "link-up": "link-up=data|ctl",
    "netem": "netem=data|ctl:loss=<pct>%,delay=<ms>ms (either or both)",
    "partition": "partition=<node>",
}


def parse_net(name: str, value: str) -> NetFault:
    """One network fault from its name and value; ValueError says what is wrong."""
    if name in ("link-down", "link-up"):
        link = _link(value)
        return LinkDownFault(link) if name == "link-down" else LinkUpFault(link)
    if name == "partition":
        try:
            return PartitionFault(peer=check_token(value, "node"))
        except ValueError:
            raise ValueError(f"{value!r} is not a node id") from None
    target, colon, opts = value.partition(":")
    if not colon or not opts:
        raise ValueError("no options after the link")
    found: dict[str, float] = {}
    for opt in opts.split(","):
        match = _NETEM.fullmatch(opt.strip())
        if match is None:
            raise ValueError(f"{opt!r} is not loss=<pct>% or delay=<ms>ms")
        key, number = (match[1], match[2]) if match[1] else (match[3], match[4])
        if key in found:
            raise ValueError(f"{key} given twice")
        found[key] = _number(number, 100.0 if key == "loss" else 60_000.0)
    return NetemFault(_link(target), loss_pct=found.get("loss"), delay_ms=found.get("delay"))


def _link(text: str) -> Link:
    for link in LINKS:
        if text == link:
            return link
    raise ValueError(f"{text!r} is not data or ctl")


def _number(text: str, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or not 0 <= value <= high:
        raise ValueError(f"{text} is out of range (0 to {high:g})")
    return value
