"""``up --netns`` without making anything: the plan's names and addresses, the refusals
that come before any namespace is made, the network faults' language, and the ranks'
collective interface defaults."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from coordinator.ctl import netns as ns
from coordinator.ctl import netns_faults
from coordinator.ctl.errors import CtlError
from nodeagent.config import collective_env
from proto.faults import parse_fault
from proto.net_faults import LinkDownFault, NetemFault, PartitionFault


def test_plan_gives_each_node_a_host_on_both_networks_with_kernel_sized_names(
    tmp_path: Path,
) -> None:
    names = [f"node-{i}" for i in range(120)]
    net = ns.plan(tmp_path, names, ns.CTL_NET, ns.DATA_NET)
    assert net.host_addr == "198.18.0.1" and net.coordinators.ctl_addr == "198.18.0.2"
    assert net.nodes["node-0"].data_addr == "198.18.1.10"
    assert net.nodes["node-119"].ctl_addr == "198.18.0.129"
    links = [net.ctl_bridge, net.data_bridge, net.coordinators.ctl_veth]
    links += [name for m in net.nodes.values() for name in (m.ctl_veth, m.data_veth)]
    assert all(len(name) <= 15 and name.startswith(net.prefix) for name in links)
    assert len(set(links)) == len(links)
    spaces = [m.namespace for m in net.nodes.values()] + [net.coordinators.namespace]
    assert all(s.startswith(f"{net.prefix}-") for s in spaces)
    data = ipaddress.ip_network(ns.DATA_NET)
    assert all(ipaddress.ip_address(m.data_addr) in data for m in net.nodes.values())
    assert ns.prefix(tmp_path) != ns.prefix(tmp_path / "other")


def test_plan_refuses_overlapping_or_too_small_networks(tmp_path: Path) -> None:
    with pytest.raises(CtlError, match="overlap") as overlap:
        ns.plan(tmp_path, ["node-0"], "198.18.0.0/23", ns.DATA_NET)
    with pytest.raises(CtlError, match="do not fit") as small:
        ns.plan(tmp_path, ["a", "b", "c", "d", "e", "f"], "198.18.4.0/28", "198.18.5.0/29")
    assert overlap.value.code == small.value.code == 2


def test_up_netns_without_root_fails_in_one_line_and_makes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ns.os, "geteuid", lambda: 1000)
    net = ns.plan(tmp_path, ["node-0"], ns.CTL_NET, ns.DATA_NET)
    with pytest.raises(CtlError, match="needs root") as refused:
        ns.create(tmp_path, net)
    assert "\n" not in str(refused.value) and refused.value.code == 1
    assert not ns.record_file(tmp_path).exists()


def test_network_faults_parse_and_are_refused_on_a_node_without_a_namespace(
    tmp_path: Path,
) -> None:
    assert parse_fault("link-down=data") == LinkDownFault("data")
    assert parse_fault("netem=data:loss=5%,delay=20ms") == NetemFault("data", 5.0, 20.0)
    assert str(parse_fault("netem=ctl:delay=3ms")) == "netem=ctl:delay=3ms"
    assert parse_fault("partition=node-2") == PartitionFault("node-2")
    for bad in ("link-down=eth0", "netem=data", "netem=data:loss=5", "partition=a.b"):
        with pytest.raises(ValueError, match="expected"):
            parse_fault(bad)
    with pytest.raises(CtlError, match="not in a network namespace") as refused:
        netns_faults.apply(tmp_path, "node-0", LinkDownFault("data"))
    assert refused.value.code == 2
    assert netns_faults.clear(tmp_path, "node-0") == []


def test_collectives_bind_to_the_data_interface_only_where_it_exists() -> None:
    assert collective_env("lo") == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert collective_env("data0-nowhere") == {}
    assert collective_env("") == {}
