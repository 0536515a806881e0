"""``up --netns``: every simulated node its own host, on two networks of this machine.

Each node gets a network namespace with two veth interfaces, ``ctl0`` on a control
bridge (NATS, the coordinators) and ``data0`` on a data bridge (the ranks' collectives);
the coordinators share one more namespace on the control bridge. The host has an
address on the control bridge, where NATS and the simulator's metadata services listen,
and one on the data bridge once a real node joins (``coordinatorctl join``: the host's
own network stack is that node's).
Nothing routes further: no default route in a namespace, no forwarding, no NAT, so the
networks reach nothing but each other.

Every name starts with a prefix derived from the cluster's directory (``rm`` and six hex
digits), short enough for the kernel's 15-character interface names and unique to the
cluster, so ``down`` can sweep by it whatever a crashed ``up`` left; ``netns.json`` in
the directory records what was planned before any of it is made.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

import msgspec

from coordinator.ctl.errors import CtlError

CTL_NET = "198.18.0.0/24"  # RFC 2544 benchmarking space: never routed on the internet
DATA_NET = "198.18.1.0/24"
FIRST_NODE_HOST = 10  # .1 the host, .2 the coordinators, nodes from .10
CTL_IF, DATA_IF = "ctl0", "data0"  # the interfaces' names inside a namespace


class NetnsNode(msgspec.Struct, kw_only=True):
    namespace: str
    ctl_addr: str
    data_addr: str = ""  # "" for the coordinators' namespace: no data network there
    ctl_veth: str  # the host side of each veth
    data_veth: str = ""


class Netns(msgspec.Struct, kw_only=True):
    prefix: str
    ctl_net: str
    data_net: str
    host_addr: str  # the host's address on the control bridge: NATS listens there
    ctl_bridge: str
    data_bridge: str
    coordinators: NetnsNode
    nodes: dict[str, NetnsNode]


def prefix(directory: Path) -> str:
    return "rm" + hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:6]


def record_file(directory: Path) -> Path:
    return directory / "netns.json"


def read(directory: Path) -> Netns | None:
    try:
        return msgspec.json.decode(record_file(directory).read_bytes(), type=Netns)
    except (OSError, msgspec.DecodeError):
        return None


def plan(directory: Path, nodes: list[str], ctl_net: str, data_net: str) -> Netns:
    """Names and addresses for ``nodes``; CtlError (exit 2) for networks too small."""
    try:
        ctl, data = ipaddress.ip_network(ctl_net), ipaddress.ip_network(data_net)
    except ValueError as exc:
        raise CtlError(f"bad network: {exc}", code=2) from None
    if ctl.overlaps(data):
        raise CtlError(f"the control network {ctl} and data network {data} overlap", code=2)
    room = min(ctl.num_addresses, data.num_addresses) - FIRST_NODE_HOST - 1
    if len(nodes) > room:
        raise CtlError(f"{len(nodes)} nodes do not fit in {ctl} and {data}", code=2)
    p = prefix(directory)
    members = {
        name: NetnsNode(
            namespace=f"{p}-{name}",
            ctl_addr=str(ctl[FIRST_NODE_HOST + i]),
            data_addr=str(data[FIRST_NODE_HOST + i]),
            ctl_veth=f"{p}c{i}",
            data_veth=f"{p}d{i}",
        )
        for i, name in enumerate(nodes)
    }
    coordinators = NetnsNode(namespace=f"{p}-coord", ctl_addr=str(ctl[2]), ctl_veth=f"{p}cc")
    return Netns(
        prefix=p,
        ctl_net=str(ctl),
        data_net=str(data),
        host_addr=str(ctl[1]),
        ctl_bridge=f"{p}-ctl",
        data_bridge=f"{p}-data",
        coordinators=coordinators,
        nodes=members,
    )


def create(directory: Path, net: Netns) -> None:
    """Make the bridges, namespaces and veths of ``net``; on any failure remove what was
    made and raise a one-line CtlError."""
    if os.geteuid() != 0:
        raise CtlError("up --netns needs root: network namespaces and bridges are made here")
    if shutil.which("ip") is None:
        raise CtlError("up --netns needs iproute2's ip command, not found on PATH")
    remove(directory)  # a crashed up's leftovers would collide with the same names
    if clash := in_use(net.ctl_net, net.data_net):
        raise CtlError(clash)
    record_file(directory).write_bytes(msgspec.json.encode(net))
    ctl_len, data_len = (ipaddress.ip_network(n).prefixlen for n in (net.ctl_net, net.data_net))
    try:
        for bridge in (net.ctl_bridge, net.data_bridge):
            ip("link", "add", bridge, "type", "bridge")
            ip("link", "set", bridge, "up")
        ip("addr", "add", f"{net.host_addr}/{ctl_len}", "dev", net.ctl_bridge)
        for member in (net.coordinators, *net.nodes.values()):
            ip("netns", "add", member.namespace)
            ip("-n", member.namespace, "link", "set", "lo", "up")
            links = [(member.ctl_veth, CTL_IF, net.ctl_bridge, member.ctl_addr, ctl_len)]
            if member.data_addr:
                links.append(
                    (member.data_veth, DATA_IF, net.data_bridge, member.data_addr, data_len)
                )
            for host_side, inside, bridge, addr, length in links:
                _veth(member.namespace, host_side, inside, bridge, f"{addr}/{length}")
    except CtlError as exc:
        remove(directory)
        raise CtlError(f"network namespaces are not available here: {exc}") from None


def in_use(*nets: str) -> str:
    """Why ``nets`` cannot be made here ("" when they can): an address of this machine
    already in one of them, such as another cluster's bridge, would take the host's
    routes to the nodes, which would then never reach NATS."""
    listed = subprocess.run(
        ["ip", "-o", "addr", "show"], capture_output=True, text=True, check=False
    )
    networks = [ipaddress.ip_network(n) for n in nets]
    for line in listed.stdout.splitlines():
        # "5: rm755f83-ctl    inet 198.18.16.1/24 brd ... scope global rm755f83-ctl"
        fields = line.split()
        if len(fields) < 4 or fields[2] != "inet":
            continue
        addr = ipaddress.ip_interface(fields[3])
        for network in networks:
            if addr.ip in network or network.overlaps(addr.network):
                return (
                    f"{network} is in use on this machine: {addr} on {fields[1]} "
                    "(another cluster's? bring it down, or choose --ctl-net and --data-net)"
                )
    return ""


def _veth(namespace: str, host_side: str, inside: str, bridge: str, addr: str) -> None:
    ip("link", "add", host_side, "type", "veth", "peer", "name", inside, "netns", namespace)
    ip("link", "set", host_side, "master", bridge, "up")
    ip("-n", namespace, "addr", "add", addr, "dev", inside)
    ip("-n", namespace, "link", "set", inside, "up")


def remove(directory: Path) -> list[str]:
    """Delete every namespace and link whose name carries this cluster's prefix (a
    namespace takes its veth ends with it; the host ends and bridges go by name), and
    the record. Returns what was removed; nothing to do without ``ip``."""
    record_file(directory).unlink(missing_ok=True)
    if shutil.which("ip") is None:
        return []
    p, removed = prefix(directory), []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    for line in listed.stdout.splitlines():
        name = line.split(" ", 1)[0]
        if name.startswith(f"{p}-") and quietly("ip", "netns", "del", name):
            removed.append(f"removed network namespace {name}")
    links = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, check=False
    )
    for line in links.stdout.splitlines():
        # "7: rm0a1b2cc0@if2: <BROADCAST,...": the name, less the peer's index
        name = line.split(": ", 2)[1].split("@", 1)[0] if ": " in line else ""
        if name.startswith(p) and quietly("ip", "link", "del", name):
            removed.append(f"removed link {name}")
    table = loss_table(p)
    if shutil.which("nft") and quietly("nft", "delete", "table", "netdev", table):
        removed.append(f"removed nftables table netdev {table}")
    return removed


def loss_table(prefix: str) -> str:
    """The cluster's nftables table of injected loss (``netns_faults``), a chain per veth;
    named by the cluster's prefix, so :func:`remove` finds it without the record."""
    return f"{prefix}_loss"


def host_on_data(net: Netns) -> str:
    """Give this host an address on the data bridge (the first of the data network, as
    it has on the control bridge), for a real node joining the cluster (``join``);
    idempotent. The address goes with the bridge at ``down``."""
    data = ipaddress.ip_network(net.data_net)
    addr = str(data[1])
    ip("addr", "replace", f"{addr}/{data.prefixlen}", "dev", net.data_bridge)
    return addr


def wrapper(net: Netns | None, member: str) -> list[str]:
    """The argv prefix that runs a process in ``member``'s namespace (a node's id, or
    "coordinators"); [] when the cluster is not namespaced."""
    if net is None:
        return []
    found = net.coordinators if member == "coordinators" else net.nodes.get(member)
    return ["ip", "netns", "exec", found.namespace] if found else []


def ip(*args: str) -> None:
    """``ip ARGS``; CtlError with its first line of complaint when it fails."""
    run("ip", *args)


def run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
        raise CtlError(f"{' '.join(argv)}: {said}")


def quietly(*argv: str) -> bool:
    """Run ``argv``, whether there is anything to undo or not: True when it did."""
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0
