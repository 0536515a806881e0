"""``up --netns``: every node its own host, on a control and a data network. A job trains
over the data network (MASTER_ADDR the master's data address, the ranks' sockets on
``data0``); a node's data link going down opens its ``net.link`` condition, the node is
drained and the job goes on elsewhere; a real node (this host) joins and trains beside a
namespaced one; ``down`` leaves no namespace, veth or bridge."""

from __future__ import annotations

import ipaddress
import subprocess
import time
from pathlib import Path

import pytest
from cli_harness import Ctl, eventually, first_event, netns_unavailable, restarted

from coordinator.ctl import local
from coordinator.ctl import netns as ns
from coordinator.ctl.errors import CtlError

WHY = netns_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(WHY), reason=WHY)]


def _lines(*argv: str) -> list[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.splitlines()


def leftovers(home: Path) -> list[str]:
    """Namespaces and links (veths, bridges) that carry this cluster's prefix."""
    p = ns.prefix(home)
    spaces = [line.split()[0] for line in _lines("ip", "netns", "list")]
    links = [line.split(": ")[1].split("@")[0] for line in _lines("ip", "-o", "link", "show")]
    return [name for name in spaces + links if name.startswith(p)]


def rank_sockets(namespace: str, pids: list[int]) -> list[tuple[str, str]]:
    """(local, peer) addresses of the TCP sockets of ``pids``, as ``ss`` in that
    namespace shows them; IPv4-mapped addresses unmapped."""
    found = []
    for line in _lines("ip", "netns", "exec", namespace, "ss", "-tnpH"):
        fields = line.split()
        if any(f"pid={pid}," in line for pid in pids):
            local, peer = (
                f.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") for f in fields[3:5]
            )
            found.append((local, peer))
    return found


@pytest.mark.timeout(300)
def test_job_trains_on_the_data_network_and_down_removes_every_namespace(
    ctl: Ctl, tmp_path: Path
) -> None:
    ctl("up", "--netns", "--nodes", "4")
    net = ns.read(ctl.home)
    assert net is not None and len(net.nodes) == 4
    data = ipaddress.ip_network(net.data_net)
    nodes = {n["id"]: n for n in ctl.status()["nodes"]}
    for name, member in net.nodes.items():
        assert nodes[name]["addr"] == member.data_addr and nodes[name]["state"] == "ready"
    job = ctl.start("tiny.toml", "train.steps=100000", f"checkpoint.dir={tmp_path / 'ckpt'}")
    ctl.wait(job, lambda s: s["step"] >= 3)
    [started] = [e for e in ctl.events("--job", job) if e["kind"] == "job.started"]
    assert ipaddress.ip_address(started["master_addr"]) in data, started
    assert started["master_addr"] == net.nodes[started["nodes"][0]].data_addr

    # the second node's rank: every TCP socket it has is on its data0 address
    second = net.nodes[started["nodes"][1]]
    sockets = rank_sockets(second.namespace, ctl.ranks(job))
    assert sockets, "the rank has no TCP socket in its namespace"
    assert all(local == second.data_addr for local, _ in sockets), sockets
    assert all(ipaddress.ip_address(peer) in data for _, peer in sockets), sockets

    assert leftovers(ctl.home)
    ctl("down")
    assert leftovers(ctl.home) == [], "down left namespaces or links behind"
    assert not ns.record_file(ctl.home).exists()


@pytest.mark.timeout(300)
def test_data_link_down_drains_the_node_and_the_job_goes_on_elsewhere(
    ctl: Ctl, tmp_path: Path
) -> None:
    ctl("up", "--netns", "--nodes", "3")
    job = ctl.start(
        "tiny.toml",
        "train.steps=100000",
        "checkpoint.every_steps=10",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    before = ctl.wait(job, lambda s: (s["last_checkpoint_step"] or 0) >= 10)
    assert sorted(before["nodes"]) == ["node-0", "node-1"]
    faulted = time.monotonic()
    ctl("inject", "node-1", "link-down=data")

    def link_condition() -> dict[str, object] | None:
        [node] = [n for n in ctl.view(None)["nodes"] if n["id"] == "node-1"]
        open_ = [c for c in node["conditions"] if c["kind"] == "net.link"]
        return node if open_ and node["state"] == "draining" else None

    eventually(link_condition, 30, lambda: "node-1's net.link never opened", 0.5)
    moved = ctl.wait(job, lambda s: "node-1" not in s["nodes"] and s["restarts"] >= 1)
    # the record may say so before the restart's event is readable: wait for the event
    resumed_from = restarted(ctl, job, moved["restarts"])["from_step"]
    after = ctl.wait(job, lambda s: s["state"] == "running" and s["step"] > resumed_from)
    seconds = time.monotonic() - faulted
    assert sorted(after["nodes"]) == ["node-0", "node-2"], moved
    print(f"==> link-down=data to the first step after: {seconds:.1f} s")

    ctl("inject", "node-1", "clear")  # the link up again: the condition closes

    def closed() -> bool:
        [node] = [n for n in ctl.view(None)["nodes"] if n["id"] == "node-1"]
        return not [c for c in node["conditions"] if c["kind"] == "net.link"]

    eventually(closed, 30, lambda: "node-1's net.link stayed open after clear", 0.5)


@pytest.mark.timeout(300)
def test_a_node_cut_off_from_its_peers_is_left_out_and_its_peers_are_not(
    ctl: Ctl, tmp_path: Path
) -> None:
    """node-2, the third node of a 3-node job, cut off from both others on the data
    network (both links up, so no link condition): its peers cannot reach it, and the
    restart leaves it out, with their word as the evidence; node-0 and node-1 stay."""
    ctl("up", "--netns", "--nodes", "4")
    job = ctl.start(
        "tiny.toml",
        "job.nodes=3",
        "train.steps=100000",
        "checkpoint.every_steps=10",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    before = ctl.wait(job, lambda s: s["state"] == "running" and s["step"] >= 10)
    assert sorted(before["nodes"]) == ["node-0", "node-1", "node-2"]
    ctl("inject", "node-2", "partition=node-0")
    ctl("inject", "node-2", "partition=node-1")
    after = ctl.wait(job, lambda s: s["restarts"] >= 1 and s["state"] == "running", timeout=120)
    assert sorted(after["nodes"]) == ["node-0", "node-1", "node-3"], after
    recovering = first_event(ctl, job, "job.recovering")
    assert "node-2: unreachable from node-0" in recovering["reason"], recovering
    assert "node-1 (cannot reach node-2" in recovering["reason"], recovering
    ctl("inject", "node-2", "clear")


@pytest.mark.timeout(300)
def test_a_real_node_joins_a_namespaced_cluster_and_trains_beside_a_simulated_one(
    ctl: Ctl, tmp_path: Path
) -> None:
    """This machine's own network stack as a node of an ``up --netns`` cluster: join gives
    the host an address on the data bridge, the agent advertises it and binds the ranks'
    collectives to the bridge, and a 2-node job trains across it to its end."""
    ctl("up", "--netns", "--nodes", "1")
    net = ns.read(ctl.home)
    assert net is not None
    joined = ctl.run("join", "real-0")
    assert joined.returncode == 0 and "real-0 joined" in joined.stderr, joined.stderr
    host_data = str(ipaddress.ip_network(net.data_net)[1])
    nodes = {n["id"]: n for n in ctl.status()["nodes"]}
    assert nodes["real-0"]["addr"] == host_data and not nodes["real-0"]["simulated"], nodes
    job = ctl.start("tiny.toml", "train.steps=30", f"checkpoint.dir={tmp_path / 'ckpt'}")
    final = ctl.wait(job, lambda s: s["state"] == "completed", timeout=200)
    assert sorted(final["nodes"]) == ["node-0", "real-0"] and final["restarts"] == 0, final
    [started] = [e for e in ctl.events("--job", job) if e["kind"] == "job.started"]
    data_addrs = {host_data, net.nodes["node-0"].data_addr}
    assert started["master_addr"] in data_addrs, started
    exits = {e["node"]: e for e in ctl.events("--job", job, "--kind", "worker.exited")}
    assert exits["real-0"]["exit_code"] == 0, exits
    ctl("down")
    assert leftovers(ctl.home) == [], "down left namespaces or links behind"


def test_down_sweeps_what_a_crashed_up_made_even_without_its_record(tmp_path: Path) -> None:
    home = tmp_path / "cluster"
    home.mkdir()
    ns.create(home, ns.plan(home, ["node-0", "node-1"], "198.18.6.0/24", "198.18.7.0/24"))
    assert len(leftovers(home)) == 3 + 2 + 5  # namespaces; bridges and host-side veths
    ns.record_file(home).unlink()  # up died before it could leave anything readable
    local.down(home)
    assert leftovers(home) == []


def test_up_refuses_networks_another_cluster_already_holds(tmp_path: Path) -> None:
    """A cluster left up (or left behind) holds 198.18.8.0/24: a second one planned on it
    is refused in one line naming the address and its bridge, and makes nothing."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    ns.create(first, ns.plan(first, ["node-0"], "198.18.8.0/24", "198.18.9.0/24"))
    try:
        with pytest.raises(CtlError) as refused:
            ns.create(second, ns.plan(second, ["node-0"], "198.18.10.0/24", "198.18.8.0/24"))
        said = str(refused.value)
        assert "198.18.8.0/24 is in use" in said and f"{ns.prefix(first)}-ctl" in said, said
        assert "\n" not in said
        assert leftovers(second) == [] and not ns.record_file(second).exists()
    finally:
        local.down(first)
