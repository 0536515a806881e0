"""The network faults of ``inject`` (``proto.net_faults``), carried out on the
namespaces, veths and bridges of ``up --netns`` (``coordinator.ctl.netns``).

A link goes down on its host side, so the node sees what a pulled cable shows, carrier
lost; netem is a ``tc`` qdisc on the node's own interface, so it shapes what the node
sends. A kernel built without ``sch_netem`` cannot delay packets at all, but it can still
lose them: loss alone then becomes an nftables rule that drops that share of what the node
sends on the link (``numgen random``) as it arrives at the veth's host side, past the
node's own stack, where netem would have lost it. (Dropped inside the node, at its output
hook, a packet is a local send error that TCP quietly tries again: no loss at all.) The
rules are one ``netdev`` table of the cluster's (:func:`netns.loss_table`), a chain per
veth, which ``down`` deletes with the rest. A partition is a pair of blackhole routes,
one in each node's namespace, for the other's data address: iproute2 is all ``--netns``
needs anyway, and a /32 blackhole beats the subnet's connected route. ``clear`` undoes
all of it for the node, and the partner's half of each partition with it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from coordinator.ctl import netns as ns
from coordinator.ctl.errors import CtlError
from proto.net_faults import (
    Link,
    LinkDownFault,
    LinkUpFault,
    NetemFault,
    NetFault,
    PartitionFault,
)

INSIDE: dict[Link, str] = {"data": ns.DATA_IF, "ctl": ns.CTL_IF}
LOSS_SCALE = 10_000  # nftables draws from 0..9999: loss to a hundredth of a percent


def apply(directory: Path, node: str, fault: NetFault) -> str:
    net, member = _member(directory, node, str(fault))
    match fault:
        case LinkDownFault(link=link) | LinkUpFault(link=link):
            state = "down" if isinstance(fault, LinkDownFault) else "up"
            ns.ip("link", "set", "dev", _veth(member, link), state)
            return f"{node}: {INSIDE[link]} link {state} (host side {_veth(member, link)})"
        case NetemFault(link=link, loss_pct=loss, delay_ms=delay):
            opts = [*(["loss", f"{loss:g}%"] if loss is not None else [])]
            opts += ["delay", f"{delay:g}ms"] if delay is not None else []
            tc = ["ip", "netns", "exec", member.namespace, "tc", "qdisc", "replace"]
            try:
                ns.run(*tc, "dev", INSIDE[link], "root", "netem", *opts)
            except CtlError as exc:
                if "unknown" not in str(exc):
                    raise
                if delay is not None or loss is None:
                    raise CtlError(
                        f"{fault}: this kernel has no netem qdisc (sch_netem), so delay "
                        f"cannot be emulated; loss alone can (netem={link}:loss=<pct>%)",
                        code=2,
                    ) from None
                return _drop(node, net, member, link, loss)
            return f"{node}: netem {' '.join(opts)} on {INSIDE[link]}"
        case PartitionFault(peer=peer):
            other = net.nodes.get(peer)
            if other is None or peer == node:
                raise CtlError(f"partition: {peer!r} is not another namespaced node", code=2)
            for here, there in ((member, other), (other, member)):
                ns.ip(
                    "-n", here.namespace, "route", "replace", "blackhole", f"{there.data_addr}/32"
                )
            return f"partitioned {node} ({member.data_addr}) from {peer} ({other.data_addr})"


def clear(directory: Path, node: str) -> list[str]:
    """Undo every network fault of ``node``; [] for a node not in a namespace."""
    net = ns.read(directory)
    member = net.nodes.get(node) if net else None
    if net is None or member is None:
        return []
    done = []
    nft = shutil.which("nft") is not None  # the loss rules of a kernel without netem
    for link in INSIDE:
        ns.quietly("ip", "link", "set", "dev", _veth(member, link), "up")
        inside = ["ip", "netns", "exec", member.namespace, "tc", "qdisc", "del"]
        if ns.quietly(*inside, "dev", INSIDE[link], "root"):
            done.append(f"netem on {INSIDE[link]}")
        chain = ["nft", "delete", "chain", "netdev", ns.loss_table(net.prefix), _veth(member, link)]
        if nft and ns.quietly(*chain):
            done.append(f"loss on {INSIDE[link]}")
    ns.quietly("ip", "-n", member.namespace, "route", "flush", "type", "blackhole")
    for peer, other in net.nodes.items():
        route = ["ip", "-n", other.namespace, "route", "del", "blackhole"]
        if peer != node and ns.quietly(*route, f"{member.data_addr}/32"):
            done.append(f"partition from {peer}")
    return [f"{node}: links up", *done]


def _drop(node: str, net: ns.Netns, member: ns.NetnsNode, link: Link, loss: float) -> str:
    """Lose ``loss`` % of what the node sends on ``link``: the veth's chain in the
    cluster's table, emptied and refilled in one transaction, so a second inject changes
    it."""
    if shutil.which("nft") is None:
        raise CtlError(
            "netem: this kernel has no netem qdisc (sch_netem), and nft (Debian's nftables) "
            "is not installed to lose packets instead",
            code=2,
        )
    table, veth = ns.loss_table(net.prefix), _veth(member, link)
    share = round(loss * LOSS_SCALE / 100)
    hook = f'type filter hook ingress device "{veth}" priority 0; policy accept;'
    ns.run(
        "nft",
        f"add table netdev {table}; add chain netdev {table} {veth} {{ {hook} }}; "
        f"flush chain netdev {table} {veth}; "
        f"add rule netdev {table} {veth} numgen random mod {LOSS_SCALE} < {share} counter drop",
    )
    return (
        f"{node}: {loss:g}% of what it sends on {INSIDE[link]} dropped (nftables at "
        f"{veth}; this kernel has no netem qdisc)"
    )


def _member(directory: Path, node: str, fault: str) -> tuple[ns.Netns, ns.NetnsNode]:
    net = ns.read(directory)
    member = net.nodes.get(node) if net else None
    if net is None or member is None:
        raise CtlError(f"{fault}: {node} is not in a network namespace (up --netns)", code=2)
    return net, member


def _veth(member: ns.NetnsNode, link: Link) -> str:
    return member.data_veth if link == "data" else member.ctl_veth
