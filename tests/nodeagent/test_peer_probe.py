"""The peer probe over real sockets: a peer whose listener goes away opens ``net.peer``
after the confirming probes, its return closes it, and a peer no job has any more
closes what was open."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

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

    prober = PeerProber("node-0", lambda: peers, emit, timeout_s=1.0, confirm=2)
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

    prober = PeerProber("node-0", lambda: peers, emit, confirm=1)
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
