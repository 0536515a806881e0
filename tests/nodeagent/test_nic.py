"""The nic collector against fixture trees and this machine's /sys, and the link detector
that turns its samples into net.link, net.flap and net.errors conditions."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from nodeagent.collectors import nic
from nodeagent.collectors.base import CollectorUnavailable, Roots
from nodeagent.collectors.nic import NicCollector, NicSample, default_route_interface
from nodeagent.config import AgentConfig, NetworkSettings, load, resolve_data_interface
from nodeagent.detectors.link import NicLinkDetector, Rise
from nodeagent.registry import build
from nodeagent.sim import agent_config
from nodeagent.sim.node import SimulatedNode
from proto.conditions import ConditionKind, Severity
from proto.events import NetErrors, NetFlap, NetLink

Tree = Callable[[str], Path]


def collector(root: Path) -> NicCollector:
    return NicCollector(Roots(sysfs=root / "sys", procfs=root / "proc"))


def detector(**settings: object) -> NicLinkDetector:
    return NicLinkDetector("node-3", NetworkSettings(**settings), "data0")  # type: ignore[arg-type]


def write(root: Path, name: str, text: str) -> None:
    (root / "sys" / "class" / "net" / name).write_text(f"{text}\n")


def at(root: Path, t: float) -> NicSample:
    return collector(root).collect(t)


def test_healthy_links_are_read_and_nothing_opens(tree: Tree) -> None:
    root = tree("sysfs_net")
    sample = at(root, 0.0)
    assert sorted(sample.interfaces) == ["data0", "eth1", "veth0"], "lo is skipped"
    assert sample.errors == {}
    data0 = sample.interfaces["data0"]
    assert (data0.carrier, data0.operstate, data0.carrier_changes) == (1, "up", 1)
    assert (data0.rx_dropped, data0.link_up, data0.physical) == (12, True, True)
    assert sample.interfaces["eth1"].rx_errors == 5
    assert not sample.interfaces["veth0"].physical
    links = detector()
    assert links.observe(sample) == [] and links.observe(at(root, 1.0)) == []


def test_data_link_down_opens_once_with_evidence_and_closes_when_up(tree: Tree) -> None:
    root = tree("sysfs_net")
    links = detector()
    assert links.observe(at(root, 0.0)) == []
    tree("sysfs_net_down")
    [down] = links.observe(at(root, 1.0))
    assert isinstance(down, NetLink) and down.condition is not None
    assert (down.interface, down.up, down.carrier, down.operstate) == ("data0", False, 0, "down")
    assert down.severity is Severity.CRITICAL and down.node == "node-3"
    cond = down.condition
    assert (cond.kind, cond.subject, cond.active) == (ConditionKind.NET_LINK, "data0", True)
    assert cond.severity is Severity.CRITICAL
    assert cond.reason == "data0 carrier 0, operstate down"
    assert links.observe(at(root, 2.0)) == [], "one event per fault, not one per sample"
    assert links.observe(at(root, 3.0)) == []
    tree("sysfs_net")
    [up] = links.observe(at(root, 4.0))
    assert isinstance(up, NetLink) and up.up and up.severity is Severity.INFO
    assert up.condition is not None and not up.condition.active
    assert up.condition.key == cond.key == "net.link:node-3:data0"


def test_a_data_interface_that_vanishes_is_down_one_never_seen_is_nothing(tree: Tree) -> None:
    root = tree("sysfs_net")
    links = detector()
    links.observe(at(root, 0.0))
    shutil.rmtree(root / "sys" / "class" / "net" / "data0")
    [gone] = links.observe(at(root, 1.0))
    assert isinstance(gone, NetLink) and gone.condition is not None
    assert (gone.up, gone.operstate) == (False, "notpresent")
    assert gone.condition.reason == "data0 gone from class/net"
    assert links.observe(at(root, 2.0)) == []
    unknown = NicLinkDetector("node-3", NetworkSettings(), "ens9")
    assert unknown.observe(at(root, 0.0)) == [] and unknown.observe(at(root, 1.0)) == []


def test_operstate_down_alone_is_a_down_link(tree: Tree) -> None:
    root = tree("sysfs_net")
    write(root, "data0/operstate", "down")
    [down] = detector().observe(at(root, 0.0))
    assert isinstance(down, NetLink) and down.message == "data link data0 carrier 1, operstate down"


def test_only_the_data_interface_opens_net_link(tree: Tree) -> None:
    root = tree("sysfs_net")
    write(root, "eth1/carrier", "0")
    write(root, "eth1/operstate", "down")
    assert detector().observe(at(root, 0.0)) == []
    other = NicLinkDetector("node-3", NetworkSettings(), "eth1")
    [down] = other.observe(at(root, 0.0))
    assert isinstance(down, NetLink) and down.interface == "eth1"


def test_carrier_einval_on_a_down_interface_reads_as_no_carrier(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel refuses to read carrier on an administratively down interface."""
    root = tree("sysfs_net")
    write(root, "data0/operstate", "down")
    real = nic.read_small

    def einval(path: str) -> str:
        if path.endswith("data0/carrier"):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real(path)

    monkeypatch.setattr(nic, "read_small", einval)
    sample = at(root, 0.0)
    assert sample.errors == {}
    assert sample.interfaces["data0"].carrier == 0
    [down] = detector().observe(sample)
    assert isinstance(down, NetLink) and down.condition is not None
    assert down.condition.reason == "data0 carrier 0, operstate down"


def test_carrier_changes_rising_is_a_flap_until_a_window_is_quiet(tree: Tree) -> None:
    root = tree("sysfs_net")
    links = detector()
    assert links.observe(at(root, 0.0)) == []
    write(root, "data0/carrier_changes", "3")  # +2: one bounce is no flap
    assert links.observe(at(root, 10.0)) == []
    write(root, "data0/carrier_changes", "5")  # +4 since t=0
    [flap] = links.observe(at(root, 20.0))
    assert isinstance(flap, NetFlap) and flap.condition is not None
    assert (flap.interface, flap.changes, flap.window_s, flap.recovered) == ("data0", 4, 60, False)
    assert flap.severity is Severity.WARNING
    assert flap.condition.reason == "data0 carrier_changes +4 in 60 s"
    assert (flap.condition.value, flap.condition.threshold) == (4.0, 3.0)
    write(root, "data0/carrier_changes", "9")
    assert links.observe(at(root, 30.0)) == [], "still flapping: no second event"
    assert links.observe(at(root, 80.0)) == [], "t=20..80 rose +4: still at the threshold"
    [steady] = links.observe(at(root, 95.0))
    assert isinstance(steady, NetFlap) and steady.recovered
    assert steady.condition is not None and not steady.condition.active


def test_virtual_interfaces_flap_unwatched_unless_asked(tree: Tree) -> None:
    root = tree("sysfs_net")
    quiet, watching = detector(), detector(watch_virtual=True)
    for links in (quiet, watching):
        links.observe(at(root, 0.0))
    write(root, "veth0/carrier_changes", "20")
    assert quiet.observe(at(root, 1.0)) == []
    [flap] = watching.observe(at(root, 1.0))
    assert isinstance(flap, NetFlap) and flap.interface == "veth0"


def test_error_counters_rising_opens_net_errors(tree: Tree) -> None:
    root = tree("sysfs_net")
    links = detector(error_rise=100, window_s=30.0)
    links.observe(at(root, 0.0))
    write(root, "eth1/statistics/rx_errors", "65")
    write(root, "eth1/statistics/tx_errors", "40")  # +60 +40 = +100
    [errors] = links.observe(at(root, 5.0))
    assert isinstance(errors, NetErrors) and errors.condition is not None
    assert (errors.interface, errors.errors, errors.recovered) == ("eth1", 100, False)
    assert errors.condition.kind is ConditionKind.NET_ERRORS
    assert errors.condition.reason == "eth1 rx_errors+tx_errors +100 in 30 s (limit 100)"
    assert links.observe(at(root, 20.0)) == []
    [over] = links.observe(at(root, 40.0))
    assert isinstance(over, NetErrors) and over.recovered and over.severity is Severity.INFO


def test_a_counter_going_backwards_starts_a_new_window() -> None:
    rise = Rise(60.0)
    assert [rise.add(0.0, 10), rise.add(1.0, 50), rise.add(2.0, 3), rise.add(3.0, 4)] == [
        0,
        40,
        0,
        1,
    ]


def test_garbage_becomes_one_line_reasons_and_the_rest_is_read(tree: Tree) -> None:
    root = tree("sysfs_net")
    tree("sysfs_net_edge")
    sample = at(root, 0.0)
    assert sorted(sample.interfaces) == ["data0", "eth1", "veth0"]
    assert sample.errors["bad0"] == "carrier holds 'banana', expected 0 or 1"
    assert sample.errors["bad1"] == "operstate holds 'sideways'"
    assert sample.errors["bad2"] == "carrier_changes holds '-3', expected a count"
    assert sample.errors["bad3"].startswith("No such file or directory: ")
    assert sample.errors["bad3"].endswith("bad3/statistics/rx_errors")
    assert all("\n" not in why and "Traceback" not in why for why in sample.errors.values())
    assert detector().observe(sample) == []


def test_no_class_net_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(CollectorUnavailable, match="cannot list"):
        collector(tmp_path).collect(0.0)


def test_the_data_interface_is_the_setting_else_the_default_route(tree: Tree) -> None:
    root = tree("sysfs_net")
    roots = Roots(sysfs=root / "sys", procfs=root / "proc")
    assert default_route_interface(roots.procfs) == "data0", "the lower metric wins"
    assert resolve_data_interface(NetworkSettings(), roots) == "data0"
    assert resolve_data_interface(NetworkSettings(data_interface="ib0"), roots) == "ib0"
    assert resolve_data_interface(NetworkSettings(), Roots(procfs=root / "nowhere")) == ""
    tree("sysfs_net_edge")
    assert default_route_interface(roots.procfs) == "data0", "a garbled line is skipped"


def test_this_machines_real_sys_class_net_reads_without_error() -> None:
    """The default roots are the real ones, and whatever links this machine has are read;
    a down interface's carrier (EINVAL) reads as 0."""
    assert Roots().sysfs == Path("/sys") and Roots().procfs == Path("/proc")
    net = Path("/sys/class/net")
    if not net.is_dir():
        pytest.skip("no /sys/class/net here")
    sample = NicCollector(Roots()).collect(0.0)
    assert sample.errors == {}
    assert sorted(sample.interfaces) == sorted(p.name for p in net.iterdir() if p.name != "lo")
    for reading in sample.interfaces.values():
        if reading.operstate == "down":
            assert reading.carrier == 0
    data = resolve_data_interface(NetworkSettings(), Roots())
    assert data == "" or data in sample.interfaces, "the default route's interface is real"
    assert NicLinkDetector("here", NetworkSettings(), data).observe(sample) == [], (
        "a first sample of a routed interface opens nothing"
    )


def test_the_registry_watches_the_configured_data_interface(tree: Tree) -> None:
    root = tree("sysfs_net")
    config = load(None, {"node": "n1", "sysfs": str(root / "sys"), "procfs": str(root / "nowhere")})
    config.network.data_interface = "eth1"
    [entry] = [e for e in build(config) if isinstance(e.collector, NicCollector)]
    [links] = entry.detectors
    assert isinstance(links, NicLinkDetector) and links.data_interface == "eth1"
    write(root, "eth1/carrier", "0")
    [down] = links.observe(entry.collector.collect(0.0))
    assert isinstance(down, NetLink) and down.interface == "eth1"


def test_a_simulated_nodes_data_link_is_up_and_watched(tmp_path: Path) -> None:
    node = SimulatedNode(tmp_path / "node-1", "node-1", 1)
    config = msgspec.convert(agent_config.settings(node) | {"node": "node-1"}, AgentConfig)
    [entry] = [e for e in build(config) if isinstance(e.collector, NicCollector)]
    [links] = entry.detectors
    assert isinstance(links, NicLinkDetector) and links.data_interface == "data0"
    sample = entry.collector.collect(0.0)
    assert sample.errors == {} and sample.interfaces["data0"].link_up
    assert links.observe(sample) == []
