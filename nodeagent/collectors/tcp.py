"""TCP's own account of loss, from ``<procfs>/net/snmp``: segments sent and segments
retransmitted since the network namespace was made.

A lossy path (a bad cable or optic, a congested switch port, a misconfigured MTU) drops
segments without any interface counting an error on this host: the drop happens on the
far side of the wire, or in a queue. TCP notices: every lost segment is sent again. The
ratio of ``RetransSegs`` to ``OutSegs`` over a window is how node_exporter's users alert
on it (``node_netstat_Tcp_RetransSegs``), and it is what tells the node whose
collectives go slowly because of its network from the peers that merely wait for it.
gloo and NCCL's socket transport both run over TCP; RDMA traffic does not, and has its
own port counters (``rdma``).

The file is per network namespace (``/proc/net`` follows the reading process's), so an
agent in its node's namespace reads that node's traffic alone. The kernel writes two
``Tcp:`` lines, names then values; anything else there is a one-line error.
"""

from __future__ import annotations

from nodeagent.collectors.base import CollectorUnavailable, Roots, Sample
from nodeagent.collectors.nvme import read_small

FIELDS = ("OutSegs", "RetransSegs")


class SnmpError(ValueError):
    """``net/snmp`` does not hold what the kernel writes there."""


class TcpSample(Sample, kw_only=True):
    out_segs: int  # segments sent, retransmissions included (RFC 4022 tcpOutSegs)
    retrans_segs: int  # segments sent again


class TcpCollector:
    name = "tcp"

    def __init__(self, roots: Roots, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._path = roots.procfs / "net" / "snmp"

    def collect(self, now: float) -> TcpSample:
        try:
            text = read_small(str(self._path))
        except FileNotFoundError as exc:
            raise CollectorUnavailable(f"no {self._path}: {exc.strerror}") from exc
        values = parse_tcp(text)
        return TcpSample(time=now, out_segs=values["OutSegs"], retrans_segs=values["RetransSegs"])


def parse_tcp(text: str) -> dict[str, int]:
    """The ``Tcp:`` counters of a ``net/snmp`` file that :data:`FIELDS` names."""
    lines = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
    if len(lines) != 2 or len(lines[0]) != len(lines[1]):
        raise SnmpError("net/snmp has no Tcp: header and value lines of one length")
    row = dict(zip(lines[0], lines[1], strict=True))
    out: dict[str, int] = {}
    for name in FIELDS:
        value = row.get(name)
        if value is None:
            raise SnmpError(f"net/snmp's Tcp: lines have no {name}")
        if not value.isdigit():
            raise SnmpError(f"net/snmp's Tcp: {name} holds {value[:20]!r}, expected a count")
        out[name] = int(value)
    return out
