"""Link conditions from ``nic`` and ``rdma`` samples: the data link down, a link flapping,
error counters rising, an RDMA port out of ACTIVE/LinkUp.

Only the data interface's link being down is critical (``net.link``): the ranks' traffic
crosses it, so a job on the node cannot make progress. Flaps and errors (``net.flap``,
``net.errors``) are warnings: the link still carries traffic, slower or with retries, and
the coordinator passes the node over for new attempts while they are open. They are
watched on the data interface and on interfaces backed by a device; virtual ones (veth,
bridges, ifb) come and go with containers and are left out unless
``network.watch_virtual``.

Counters are judged over a sliding window of sample time (``network.window_s``): a
condition opens when a counter rose by its threshold within the window and closes once it
rose by less over a whole window, so the window is the hysteresis. A counter that went
backwards (the interface was recreated) starts a new window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from nodeagent.collectors.nic import NicReading, NicSample
from nodeagent.collectors.rdma import RdmaPortReading, RdmaSample
from nodeagent.config import NetworkSettings
from nodeagent.detectors.latch import Change, ConditionLatch, ConditionLatches
from proto.conditions import Condition, ConditionKind, Severity
from proto.events import EventBase, NetErrors, NetFlap, NetLink, RdmaPort


class Rise:
    """How much a cumulative counter rose over the last ``window_s`` of sample time,
    measured from the newest sample at or before the window's start."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, int]] = deque()

    def add(self, t: float, value: int) -> int:
        if self._seen and value < self._seen[-1][1]:
            self._seen.clear()
        self._seen.append((t, value))
        while len(self._seen) > 1 and self._seen[1][0] <= t - self.window_s:
            self._seen.popleft()
        return value - self._seen[0][1]


# What a vanished interface reads as: RFC 2863's "notPresent", no carrier.
GONE = NicReading(
    carrier=0,
    operstate="notpresent",
    carrier_changes=0,
    rx_errors=0,
    tx_errors=0,
    rx_dropped=0,
    tx_dropped=0,
    physical=False,
)


class NicLinkDetector:
    def __init__(self, node: str, network: NetworkSettings, data_interface: str) -> None:
        self.node, self.network, self.data_interface = node, network, data_interface
        self._link = ConditionLatches(
            ConditionKind.NET_LINK, node, severity=Severity.CRITICAL, confirm=1, hold_s=0.0
        )
        self._flap = ConditionLatches(
            ConditionKind.NET_FLAP, node, severity=Severity.WARNING, confirm=1, hold_s=0.0
        )
        self._errors = ConditionLatches(
            ConditionKind.NET_ERRORS, node, severity=Severity.WARNING, confirm=1, hold_s=0.0
        )
        self._changes: dict[str, Rise] = {}
        self._errs: dict[str, Rise] = {}
        self._data_seen = False

    def observe(self, sample: NicSample) -> list[EventBase]:
        events: list[EventBase] = []
        t, data = sample.time, self.data_interface
        for name, reading in sorted(sample.interfaces.items()):
            if name == data:
                self._data_seen = True
                events += self._link_state(name, reading, t)
            if name == data or reading.physical or self.network.watch_virtual:
                events += self._flaps(name, reading, t)
                events += self._error_rise(name, reading, t)
        if self._data_seen and data not in sample.interfaces and data not in sample.errors:
            # Once seen, a data interface that vanished (its NIC or driver gone) is a link
            # down; one never seen is a setting naming nothing, no evidence against the node.
            events += self._link_state(data, GONE, t)
        return events

    def _link_state(self, name: str, r: NicReading, t: float) -> list[EventBase]:
        latch = self._link[name]
        change = latch.update(not r.link_up, t)
        if change is None:
            return []
        down = change is Change.RAISED
        reason = f"{name} carrier {r.carrier}, operstate {r.operstate}"
        if r is GONE:
            reason = f"{name} gone from class/net"
        message = f"data link {reason}" if down else f"data link up again: {reason}"
        return [
            NetLink(
                severity=Severity.CRITICAL if down else Severity.INFO,
                node=self.node,
                interface=name,
                up=not down,
                carrier=r.carrier,
                operstate=r.operstate,
                message=message,
                condition=latch.record(change, t, reason=reason, value=float(r.carrier)),
            )
        ]

    def _flaps(self, name: str, r: NicReading, t: float) -> list[EventBase]:
        limit = self.network.flap_changes
        rise = self._changes.setdefault(name, Rise(self.network.window_s))

        def say(count: int, opened: bool) -> str:
            what = f"{name} carrier_changes +{count} in {self.network.window_s:g} s"
            return what if opened else f"{what}, under {limit}: steady again"

        judged = self._judge(self._flap[name], rise, r.carrier_changes, limit, t, say)
        if judged is None:
            return []
        count, opened, message, condition = judged
        return [
            NetFlap(
                severity=Severity.WARNING if opened else Severity.INFO,
                node=self.node,
                interface=name,
                changes=count,
                window_s=self.network.window_s,
                recovered=not opened,
                message=message,
                condition=condition,
            )
        ]

    def _error_rise(self, name: str, r: NicReading, t: float) -> list[EventBase]:
        limit = self.network.error_rise
        rise = self._errs.setdefault(name, Rise(self.network.window_s))

        def say(count: int, opened: bool) -> str:
            what = f"{name} rx_errors+tx_errors +{count} in {self.network.window_s:g} s"
            return f"{what} (limit {limit})" if opened else f"{what}, under {limit} again"

        errors = r.rx_errors + r.tx_errors
        judged = self._judge(self._errors[name], rise, errors, limit, t, say)
        if judged is None:
            return []
        count, opened, message, condition = judged
        return [
            NetErrors(
                severity=Severity.WARNING if opened else Severity.INFO,
                node=self.node,
                interface=name,
                errors=count,
                window_s=self.network.window_s,
                recovered=not opened,
                message=message,
                condition=condition,
            )
        ]

    @staticmethod
    def _judge(
        latch: ConditionLatch,
        rise: Rise,
        counter: int,
        limit: int,
        t: float,
        say: Callable[[int, bool], str],
    ) -> tuple[int, bool, str, Condition] | None:
        """A counter's rise over the window against its limit, through its latch: the
        rise, whether the condition opened, ``say``'s message and the condition's record;
        None when nothing changed."""
        count = rise.add(t, counter)
        change = latch.update(count >= limit, t)
        if change is None:
            return None
        opened = change is Change.RAISED
        message = say(count, opened)
        record = latch.record(change, t, reason=message, value=float(count), threshold=float(limit))
        return count, opened, message, record


class RdmaPortDetector:
    """``rdma.port`` for a port out of ACTIVE/LinkUp. By default only ports seen up since
    the agent started are watched (``network.rdma_watch = "seen_active"``): a port that was
    never cabled is no fault, and a condition would keep the node out of every job."""

    def __init__(self, node: str, network: NetworkSettings) -> None:
        self.node, self.network = node, network
        self._seen_up: set[str] = set()
        self._latches = ConditionLatches(
            ConditionKind.RDMA_PORT, node, severity=Severity.WARNING, confirm=1, hold_s=0.0
        )

    def observe(self, sample: RdmaSample) -> list[EventBase]:
        events: list[EventBase] = []
        for key, reading in sorted(sample.ports.items()):
            if reading.up:
                self._seen_up.add(key)
            if self.network.rdma_watch == "all" or key in self._seen_up:
                events += self._port(key, reading, sample.time)
        return events

    def _port(self, key: str, r: RdmaPortReading, t: float) -> list[EventBase]:
        latch = self._latches[key]
        change = latch.update(not r.up, t)
        if change is None:
            return []
        down = change is Change.RAISED
        reason = f"{key} state {r.state}, phys_state {r.phys_state}"
        device, _, port = key.rpartition("/")
        return [
            RdmaPort(
                severity=Severity.WARNING if down else Severity.INFO,
                node=self.node,
                device=device,
                port=int(port) if port.isdigit() else 0,
                state=r.state,
                phys_state=r.phys_state,
                up=not down,
                message=reason if down else f"{reason}: up again",
                condition=latch.record(change, t, reason=reason),
            )
        ]
