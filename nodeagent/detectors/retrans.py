"""``net.retrans`` from ``tcp`` samples: this node's TCP retransmits a share of what it
sends that no healthy path does, so its path loses packets.

Loss rarely shows on the host that suffers it: the frames die in a cable, an optic or a
switch queue, and no interface counter moves (``net.errors`` stays quiet). It shows as
retransmissions, and as collectives that take longer for every rank, which no rank can
single out: a straggler window compares ranks' compute times, and every rank waits in the
same slow collective. The node whose TCP resends is the one whose path drops.

Both counters are judged over the same sliding window (``network.retrans_window_s``): the
condition opens when the window's retransmitted share reaches ``retrans_ratio`` with at
least ``retrans_min_segs`` sent, and closes when a window's share is under it or too few
segments were sent to say (a node whose job left is no longer evidence against itself).
The window is the hysteresis. A counter that went backwards starts a new window.
"""

from __future__ import annotations

from nodeagent.collectors.tcp import TcpSample
from nodeagent.config import NetworkSettings
from nodeagent.detectors.latch import Change, ConditionLatch
from nodeagent.detectors.link import Rise
from proto.conditions import ConditionKind, Severity
from proto.events import EventBase, NetRetrans


class TcpRetransDetector:
    def __init__(self, node: str, network: NetworkSettings) -> None:
        self.node, self.network = node, network
        window = network.retrans_window_s
        self._sent, self._resent = Rise(window), Rise(window)
        self._latch = ConditionLatch(
            ConditionKind.NET_RETRANS, node, "", severity=Severity.WARNING, confirm=1, hold_s=0.0
        )

    def observe(self, sample: TcpSample) -> list[EventBase]:
        net, t = self.network, sample.time
        sent = self._sent.add(t, sample.out_segs)
        resent = self._resent.add(t, sample.retrans_segs)
        ratio = resent / sent if sent > 0 else 0.0
        enough = sent >= net.retrans_min_segs
        change = self._latch.update(enough and ratio >= net.retrans_ratio, t)
        if change is None:
            return []
        opened = change is Change.RAISED
        window = f"{net.retrans_window_s:g} s"
        if opened:
            message = (
                f"TCP retransmitted {ratio:.1%} of {sent} segments sent in {window} "
                f"(limit {net.retrans_ratio:.1%}): a lossy network path"
            )
        elif enough:
            message = f"TCP retransmitted {ratio:.2%} of {sent} segments in {window}: under again"
        else:
            message = f"TCP sent {sent} segments in {window}: too few to show loss, closed"
        condition = self._latch.record(
            change, t, reason=message, value=round(ratio, 5), threshold=net.retrans_ratio
        )
        return [
            NetRetrans(
                severity=Severity.WARNING if opened else Severity.INFO,
                node=self.node,
                retrans_segs=resent,
                out_segs=sent,
                ratio=round(ratio, 5),
                window_s=net.retrans_window_s,
                recovered=not opened,
                message=message,
                condition=condition,
            )
        ]
