"""The peer probe over real sockets: a peer whose listener goes away opens ``net.peer``
after the confirming probes, its return closes it, and a peer no job has any more
closes what was open; a peer that refuses for less than an agent restart's grace says
nothing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from nodeagent import peer_probe
from nodeagent.peer_probe import PeerProber, ProbeListener, listen, reach
from proto.conditions import ConditionKind, Severity
from proto.events import EventBase, NetPeer

pytestmark = pytest.mark.anyio


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_reach_says_why_not() -> None:
    listener = ProbeListener("127.0.0.1")
    port = await listener.start()
    try:
        assert await reach(f"127.0.0.1:{port}", 1.0) is None
    finally:
        await listener.close()
    assert await reach(f"127.0.0.1:{closed_port()}", 1.0) == "Connection refused"
    assert await reach("no-port", 1.0)  # a malformed address is an error, not a crash


async def test_an_unreachable_peer_opens_net_peer_once_and_its_return_closes_it() -> None:
    listener = ProbeListener("127.0.0.1")
    port = await listener.start()
    peers = {"node-1": f"127.0.0.1:{port}", "node-0": "127.0.0.1:1"}  # itself: never probed
    emitted: list[EventBase] = []

    async def emit(event: EventBase) -> None:
        emitted.append(event)

    # no restart grace: a refusing listener counts at once (the grace has its own test)
    prober = PeerProber("node-0", lambda: peers, emit, timeout_s=1.0, confirm=2, restart_grace_s=0)
    assert await prober.probe_once(1.0) == []  # reachable: nothing to say
    await listener.close()
    assert await prober.probe_once(2.0) == []  # one failure is not yet evidence
    [lost] = await prober.probe_once(3.0)
    assert lost.peer == "node-1" and not lost.reachable and lost.error
    assert lost.condition is not None and lost.condition.active
    assert lost.condition.kind is ConditionKind.NET_PEER and lost.condition.subject == "node-1"
    assert lost.condition.severity is Severity.INFO  # advisory on the reporter
    assert f"cannot reach node-1 at 127.0.0.1:{port}" in lost.condition.reason
    assert await prober.probe_once(4.0) == []  # still lost: said once

    back = ProbeListener("127.0.0.1", port)
    await back.start()
    try:
        [found] = await prober.probe_once(5.0)
        assert found.reachable and found.condition is not None and not found.condition.active
    finally:
        await back.close()
    assert emitted == [lost, found]


async def test_a_peer_no_job_has_any_more_closes_its_open_condition() -> None:
    peers = {"node-1": f"127.0.0.1:{closed_port()}"}

    async def emit(event: EventBase) -> None:
        pass

    prober = PeerProber("node-0", lambda: peers, emit, confirm=1, restart_grace_s=0)
    [lost] = await prober.probe_once(1.0)
    assert isinstance(lost, NetPeer) and not lost.reachable
    peers.clear()  # the job ended, or moved off this node
    [closed] = await prober.probe_once(2.0)
    assert closed.reachable and closed.condition is not None and not closed.condition.active
    assert await prober.probe_once(3.0) == []


async def test_a_restarted_agent_listens_on_its_old_port_where_it_is_free(tmp_path: Path) -> None:
    record = tmp_path / "probe-port"
    first, port = await listen("127.0.0.1", 0, record)
    await first.close()
    again, same = await listen("127.0.0.1", 0, record)  # the launches named this port
    assert same == port and record.read_text().strip() == str(port)
    try:
        other, new = await listen("127.0.0.1", 0, record)  # taken: a new one
        await other.close()
        assert new != port and record.read_text().strip() == str(new)
    finally:
        await again.close()
    record.write_text("garbage")
    fresh, _ = await listen("127.0.0.1", 0, record)
    await fresh.close()


async def test_a_peer_refusing_within_an_agent_restart_says_nothing() -> None:
    """Its agent restarted by systemd: the machine refuses the probes until the agent
    listens on its port again, inside the grace; nothing is published. Refusals that
    outlast the grace count (a firewall that rejects, an agent that stays down)."""
    listener = ProbeListener("127.0.0.1")
    port = await listener.start()
    peers = {"node-1": f"127.0.0.1:{port}"}
    emitted: list[EventBase] = []

    async def emit(event: EventBase) -> None:
        emitted.append(event)

    prober = PeerProber("node-0", lambda: peers, emit, confirm=2, restart_grace_s=15.0)
    assert await prober.probe_once(0.0) == []
    await listener.close()  # the agent stops; systemd starts it again
    for t in (2.0, 4.0, 6.0, 8.0):
        assert await prober.probe_once(t) == []
    back = ProbeListener("127.0.0.1", port)
    await back.start()
    try:
        assert await prober.probe_once(10.0) == []  # back on its port: never a fault
    finally:
        await back.close()
    for t in (20.0, 30.0, 35.0):  # refused again from 20 s: its own grace starts there
        assert await prober.probe_once(t) == []  # 35 s: the first failure of two
    [lost] = await prober.probe_once(37.0)
    assert not lost.reachable and "Connection refused for 17 s" in lost.error, lost.error
    assert emitted == [lost]


async def test_a_peer_that_does_not_answer_counts_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A blackhole route or a dropped path is no agent restart: the grace is not waited."""

    async def blackhole(addr: str, timeout_s: float) -> str:
        return "Invalid argument"

    monkeypatch.setattr(peer_probe, "reach", blackhole)

    async def emit(event: EventBase) -> None:
        pass

    prober = PeerProber("node-0", lambda: {"node-1": "198.18.1.4:9"}, emit, confirm=2)
    assert await prober.probe_once(1.0) == []
    [lost] = await prober.probe_once(2.0)
    assert not lost.reachable and lost.error == "Invalid argument", lost.error
