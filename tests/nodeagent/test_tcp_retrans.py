"""The tcp collector against ``net/snmp`` texts as the kernel writes them (and as it never
does), the detector that turns its samples into ``net.retrans``, and both on a real
lossy link: two network namespaces on a bridge, ``inject``'s loss on one node's data0,
that node's own TCP counters read through ``/proc/<pid>/net/snmp``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.ctl import netns as ns
from coordinator.ctl import netns_faults
from coordinator.ctl.errors import CtlError
from nodeagent.collectors.base import CollectorUnavailable, Roots
from nodeagent.collectors.tcp import SnmpError, TcpCollector, TcpSample, parse_tcp
from nodeagent.config import AgentConfig, NetworkSettings
from nodeagent.detectors.retrans import TcpRetransDetector
from nodeagent.registry import build
from proto.conditions import ConditionKind, Severity
from proto.events import NetRetrans
from proto.net_faults import NetemFault
from ringmaster.clock import ManualClock
from ringmaster.procs import wait_until

HEADER = (
    "Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails "
    "EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors"
)


def snmp(out: int, retrans: int) -> str:
    return (
        "Ip: Forwarding DefaultTTL\nIp: 1 64\n"
        f"{HEADER}\nTcp: 1 200 120000 -1 3 2 0 0 1 640 {out} {retrans} 0 0 0\n"
        "Udp: InDatagrams NoPorts\nUdp: 0 0\n"
    )


def test_the_kernels_tcp_lines_are_read_by_name() -> None:
    assert parse_tcp(snmp(656, 17)) == {"OutSegs": 656, "RetransSegs": 17}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "no Tcp: header and value lines"),
        (f"{HEADER}\n", "no Tcp: header and value lines"),
        ("Tcp: OutSegs\nTcp: 1 2\n", "no Tcp: header and value lines of one length"),
        ("Tcp: InSegs OutSegs\nTcp: 1 2\n", "have no RetransSegs"),
        ("Tcp: OutSegs RetransSegs\nTcp: 12 -1\n", "RetransSegs holds '-1', expected a count"),
    ],
)
def test_what_the_kernel_never_writes_is_one_line_naming_it(text: str, said: str) -> None:
    with pytest.raises(SnmpError, match=said):
        parse_tcp(text)


def test_the_collector_reads_its_procfs_and_says_when_there_is_none(tmp_path: Path) -> None:
    collector = TcpCollector(Roots(procfs=tmp_path))
    with pytest.raises(CollectorUnavailable, match="net/snmp"):
        collector.collect(0.0)
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "snmp").write_text(snmp(1000, 3))
    assert collector.collect(5.0) == TcpSample(time=5.0, out_segs=1000, retrans_segs=3)


def test_this_machines_own_counters_read() -> None:
    sample = TcpCollector(Roots()).collect(0.0)
    assert sample.out_segs >= sample.retrans_segs >= 0


def detector(**settings: object) -> TcpRetransDetector:
    defaults: dict[str, object] = {"retrans_window_s": 10.0, "retrans_min_segs": 1000}
    return TcpRetransDetector("node-2", NetworkSettings(**(defaults | settings)))  # type: ignore[arg-type]


def feed(d: TcpRetransDetector, rows: list[tuple[float, int, int]]) -> list[NetRetrans]:
    out = []
    for t, sent, resent in rows:
        for event in d.observe(TcpSample(time=t, out_segs=sent, retrans_segs=resent)):
            assert isinstance(event, NetRetrans)
            out.append(event)
    return out


def test_a_lossy_window_opens_once_with_its_evidence_and_a_clean_one_closes() -> None:
    d = detector()
    # 0.5 % retransmitted: healthy enough; then 5 % for 20 s; then clean again
    rows = [(float(t), 2000 * t, 10 * t) for t in range(11)]
    rows += [(float(t), 2000 * t, 100 + 100 * (t - 10)) for t in range(11, 31)]
    rows += [(float(t), 2000 * t, 2100) for t in range(31, 50)]
    events = feed(d, rows)
    assert [e.recovered for e in events] == [False, True]
    opened, closed = events
    assert opened.severity is Severity.WARNING and opened.node == "node-2"
    assert opened.condition is not None and opened.condition.kind is ConditionKind.NET_RETRANS
    assert opened.condition.active and opened.condition.threshold == 0.01
    assert opened.ratio >= 0.01 and "TCP retransmitted" in opened.message
    assert opened.out_segs >= 1000
    assert closed.severity is Severity.INFO and closed.condition is not None
    assert not closed.condition.active and "under again" in closed.message
    # the window is the hysteresis: closed once the loss has left enough of it
    assert 30.0 < closed.condition.since <= 40.0


def test_too_few_segments_are_no_evidence_and_close_an_open_condition() -> None:
    d = detector()
    # 50 of 500 segments retransmitted in a window: 10 %, but too few to judge
    assert feed(d, [(float(t), 50 * t, 5 * t) for t in range(12)]) == []
    opened = feed(d, [(12.0 + t, 600 + 2000 * t, 60 + 200 * t) for t in range(12)])
    assert [e.recovered for e in opened] == [False]
    # the job left: almost nothing sent, nothing held against the node
    last = 600 + 2000 * 11
    closed = feed(d, [(24.0 + t, last + t, 60 + 200 * 11) for t in range(12)])
    assert [e.recovered for e in closed] == [True] and "too few" in closed[0].message


def test_counters_that_went_back_start_a_new_window() -> None:
    d = detector()
    assert feed(d, [(0.0, 10**6, 10**5), (1.0, 10**6 + 10, 10**5)]) == []
    # the namespace was made anew: counters from zero; no negative rise, nothing opens
    assert feed(d, [(2.0, 5, 0), (3.0, 2000, 1)]) == []


def test_the_agent_registers_tcp_with_the_link_collectors(tmp_path: Path) -> None:
    config = AgentConfig(node="n1", procfs=str(tmp_path), sysfs=str(tmp_path))
    [entry] = [e for e in build(config) if isinstance(e.collector, TcpCollector)]
    assert [type(d) for d in entry.detectors] == [TcpRetransDetector]
    with pytest.raises(CollectorUnavailable):
        entry.collector.collect(0.0)  # the tree has no net/snmp
    network = NetworkSettings(tcp_procfs="/proc")
    moved = AgentConfig(node="n1", procfs=str(tmp_path), sysfs=str(tmp_path), network=network)
    [tcp] = [e.collector for e in build(moved) if isinstance(e.collector, TcpCollector)]
    assert isinstance(tcp.collect(0.0), TcpSample), "tcp_procfs is where it reads"


# -- a real lossy link -----------------------------------------------------------------

SINK = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen()
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
while c.recv(1 << 16):
    pass
"""

# sends in bursts with a pause between, so there is always data in flight to lose
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    c.sendall(b"x" * 65536)
    time.sleep(0.005)
"""


def _namespaces_unavailable() -> str:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "network namespaces need root and iproute2"
    probe = f"rmtcp-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "network namespaces cannot be made here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return ""


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[Path, ns.Netns]]:
    if why := _namespaces_unavailable():
        pytest.skip(why)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    third = 100 + 2 * int(worker or 0)
    net = ns.plan(tmp_path, ["n-a", "n-b"], f"198.18.{third}.0/24", f"198.18.{third + 1}.0/24")
    ns.create(tmp_path, net)
    try:
        yield tmp_path, net
    finally:
        ns.remove(tmp_path)


def _in(namespace: str, script: str, *args: str) -> subprocess.Popen[str]:
    argv = ["ip", "netns", "exec", namespace, sys.executable, "-c", script, *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def _watch(d: TcpRetransDetector, clock: ManualClock, pid: int, seconds: float) -> list[NetRetrans]:
    """Samples the namespace of ``pid`` every 0.25 s (of real time, and of ``clock``'s,
    which the samples are stamped with) until an event, or ``seconds`` have passed."""
    collector = TcpCollector(Roots(procfs=Path(f"/proc/{pid}")), 0.25)

    def events() -> list[NetRetrans]:
        clock.advance(0.25)
        sample = collector.collect(clock.time())
        return [e for e in d.observe(sample) if isinstance(e, NetRetrans)]

    try:
        return wait_until(events, seconds, interval=0.25)
    except TimeoutError:
        return []


@pytest.mark.timeout(180)
def test_loss_injected_on_a_nodes_data_link_opens_net_retrans_there(
    two_nodes: tuple[Path, ns.Netns],
) -> None:
    home, net = two_nodes
    a, b = net.nodes["n-a"], net.nodes["n-b"]
    if shutil.which("nft") is None and not _has_netem(a.namespace):
        pytest.skip("neither the netem qdisc nor nft (Debian's nftables) is here to lose packets")
    if not _has_netem(a.namespace):  # delay needs the qdisc: one line, exit 2
        with pytest.raises(CtlError) as refused:
            netns_faults.apply(home, "n-a", NetemFault("data", loss_pct=5.0, delay_ms=20.0))
        assert refused.value.code == 2 and "\n" not in str(refused.value)
        assert "delay cannot be emulated" in str(refused.value)
    said = netns_faults.apply(home, "n-a", NetemFault("data", loss_pct=5.0))
    assert "n-a" in said and "data0" in said, said
    sink = _in(b.namespace, SINK, b.data_addr)
    try:
        assert sink.stdout is not None
        port = sink.stdout.readline().strip()
        source = _in(a.namespace, SOURCE, b.data_addr, port, "150")
        settings = {"retrans_window_s": 2.0, "retrans_min_segs": 200}
        watch, clock = detector(**settings), ManualClock()
        lossy = _watch(watch, clock, source.pid, 45)
        assert [e.recovered for e in lossy] == [False], "no net.retrans on the lossy node"
        assert lossy[0].ratio >= 0.01, lossy[0].message

        undone = netns_faults.clear(home, "n-a")
        assert any(part.endswith("on data0") for part in undone), undone
        # segments lost before the clear are still sent again after it (backed off), so
        # the condition closes once a whole window is clean, with the stream still going
        [closed] = _watch(watch, clock, source.pid, 60)
        assert closed.recovered and "under again" in closed.message, closed.message
        source.kill()
        source.wait()
    finally:
        sink.kill()
        sink.wait()
    if "nftables" in said:  # down removes the cluster's loss table with the namespaces
        netns_faults.apply(home, "n-b", NetemFault("data", loss_pct=1.0))
        assert f"removed nftables table netdev {ns.loss_table(net.prefix)}" in ns.remove(home)
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
        assert ns.loss_table(net.prefix) not in tables.stdout, "down left the loss table behind"


def _has_netem(namespace: str) -> bool:
    """Whether this kernel has the netem qdisc (inject then uses it, not nftables)."""
    tc = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
    made = subprocess.run([*tc, "add", "dev", "lo", "root", "netem"], capture_output=True)
    subprocess.run([*tc, "del", "dev", "lo", "root"], capture_output=True, check=False)
    return made.returncode == 0
