"""What the link collectors read: ``class/net/<if>/`` and ``class/infiniband/<dev>/ports/``
files holding anything. The contract: a sample with each bad interface or port as a
one-line entry in ``errors`` beside the healthy ones, never an exception, and the
detector takes any such sample."""

from __future__ import annotations

import tempfile
from pathlib import Path

from fuzz_support import counted, one_line
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.collectors.base import Roots
from nodeagent.collectors.nic import NicCollector
from nodeagent.collectors.rdma import RdmaCollector
from nodeagent.config import NetworkSettings
from nodeagent.detectors.link import NicLinkDetector, RdmaPortDetector

NIC_FILES = ("carrier", "operstate", "carrier_changes", "statistics/rx_errors")
GOOD_NIC = {"carrier": b"1\n", "operstate": b"up\n", "carrier_changes": b"2\n"} | {
    f"statistics/{c}": b"0\n" for c in ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped")
}
GOOD_PORT = {"state": b"4: ACTIVE\n", "phys_state": b"5: LinkUp\n", "counters/link_downed": b"0\n"}
contents = st.one_of(
    st.binary(max_size=60),
    st.sampled_from([b"", b"0", b"1\n", b"down", b"-1", b"9" * 400, b"4: ACTIVE", b"\xff\n"]),
)


def _write(base: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_bytes(data)


@given(st.dictionaries(st.sampled_from(NIC_FILES), contents, min_size=1))
@counted
def test_nic_collector(bad: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-net-") as name:
        net = Path(name) / "class" / "net"
        _write(net / "data0", GOOD_NIC)
        _write(net / "data1", GOOD_NIC | bad)
        sample = NicCollector(Roots(sysfs=Path(name))).collect(1.0)
        assert "data0" in sample.interfaces, sample.errors
        assert ("data1" in sample.interfaces) != ("data1" in sample.errors)
        assert all(one_line(why) for why in sample.errors.values())
        links = NicLinkDetector("n", NetworkSettings(), "data1")
        links.observe(sample)
        links.observe(sample)


@given(st.dictionaries(st.sampled_from(list(GOOD_PORT)), contents, min_size=1))
@counted
def test_rdma_collector(bad: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-ib-") as name:
        ib = Path(name) / "class" / "infiniband"
        _write(ib / "mlx5_0" / "ports" / "1", GOOD_PORT)
        _write(ib / "mlx5_1" / "ports" / "1", GOOD_PORT | bad)
        sample = RdmaCollector(Roots(sysfs=Path(name))).collect(1.0)
        assert "mlx5_0/1" in sample.ports, sample.errors
        assert ("mlx5_1/1" in sample.ports) != ("mlx5_1/1" in sample.errors)
        assert all(one_line(why) for why in sample.errors.values())
        RdmaPortDetector("n", NetworkSettings(rdma_watch="all")).observe(sample)
