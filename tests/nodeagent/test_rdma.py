"""The rdma collector against fixture trees, and rdma.port conditions from its samples."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from nodeagent.collectors.base import CollectorUnavailable, Roots
from nodeagent.collectors.rdma import RdmaCollector, RdmaPortReading, RdmaSample, parse_state
from nodeagent.config import NetworkSettings
from nodeagent.detectors.link import RdmaPortDetector
from proto.conditions import ConditionKind, Severity
from proto.events import RdmaPort

Tree = Callable[[str], Path]


def at(root: Path, t: float) -> RdmaSample:
    return RdmaCollector(Roots(sysfs=root / "sys")).collect(t)


def test_ports_are_read_with_their_counters(tree: Tree) -> None:
    sample = at(tree("sysfs_rdma"), 0.0)
    assert sample.errors == {}
    assert sample.ports == {
        "mlx5_0/1": RdmaPortReading(
            state="ACTIVE",
            phys_state="LinkUp",
            counters={
                "symbol_error": 0,
                "link_error_recovery": 0,
                "link_downed": 1,
                "port_rcv_errors": 0,
            },
        ),
        "mlx5_1/1": RdmaPortReading(state="DOWN", phys_state="Polling"),
    }
    assert sample.ports["mlx5_0/1"].up and not sample.ports["mlx5_1/1"].up


def test_a_port_that_was_active_and_goes_down_opens_once_and_closes(tree: Tree) -> None:
    root = tree("sysfs_rdma")
    ports = RdmaPortDetector("node-2", NetworkSettings())
    assert ports.observe(at(root, 0.0)) == [], "mlx5_1/1 was never up: not watched"
    tree("sysfs_rdma_down")
    [down] = ports.observe(at(root, 1.0))
    assert isinstance(down, RdmaPort) and down.condition is not None
    assert (down.device, down.port, down.state, down.phys_state) == (
        "mlx5_0",
        1,
        "DOWN",
        "Disabled",
    )
    assert not down.up and down.severity is Severity.WARNING
    assert down.condition.kind is ConditionKind.RDMA_PORT
    assert down.condition.key == "rdma.port:node-2:mlx5_0/1"
    assert down.condition.reason == "mlx5_0/1 state DOWN, phys_state Disabled"
    assert ports.observe(at(root, 2.0)) == []
    tree("sysfs_rdma")
    [up] = ports.observe(at(root, 3.0))
    assert isinstance(up, RdmaPort) and up.up and up.condition is not None
    assert not up.condition.active


def test_every_port_is_watched_when_asked(tree: Tree) -> None:
    [down] = RdmaPortDetector("node-2", NetworkSettings(rdma_watch="all")).observe(
        at(tree("sysfs_rdma"), 0.0)
    )
    assert isinstance(down, RdmaPort) and (down.device, down.state) == ("mlx5_1", "DOWN")


def test_garbage_is_a_one_line_reason_and_other_ports_are_read(tree: Tree) -> None:
    root = tree("sysfs_rdma")
    port = root / "sys" / "class" / "infiniband" / "mlx5_1" / "ports" / "1"
    (port / "state").write_text("fine, thanks\n")
    (root / "sys" / "class" / "infiniband" / "mlx5_2").mkdir()  # no ports/
    counters = root / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters"
    sample = at(root, 0.0)
    assert sample.errors["mlx5_1/1"] == "state holds 'fine, thanks', expected 'N: NAME'"
    assert sample.errors["mlx5_2"].startswith("No such file or directory: ")
    assert list(sample.ports) == ["mlx5_0/1"]
    (counters / "symbol_error").write_text("many\n")
    assert at(root, 1.0).errors["mlx5_0/1"] == "symbol_error holds 'many', expected a count"
    assert RdmaPortDetector("n", NetworkSettings()).observe(at(root, 1.0)) == []


def test_no_infiniband_class_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(CollectorUnavailable, match="no RDMA devices"):
        at(tmp_path, 0.0)
    (tmp_path / "sys" / "class" / "infiniband").mkdir(parents=True)
    with pytest.raises(CollectorUnavailable, match="no RDMA devices under"):
        at(tmp_path, 0.0)


def test_state_lines() -> None:
    assert parse_state("4: ACTIVE\n", "state") == "ACTIVE"
    assert parse_state("5: LinkUp", "phys_state") == "LinkUp"
    assert parse_state("7: PhyTest", "phys_state") == "PhyTest"
