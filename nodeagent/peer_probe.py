"""Whether this node reaches the other nodes of its jobs over the data network.

A partition (traffic between two nodes dropped, both links up) raises no link condition:
every rank then waits in a collective, and no node can tell whose fault it is from its
own ranks. So each agent listens on its data address (:class:`ProbeListener`, the port
in its heartbeat) and, while it runs a job's ranks, connects to the listener of each of
the job's other nodes every few seconds (:class:`PeerProber`; the coordinator names them
in the launch). ``probe.confirm`` failed connects in a row open ``net.peer`` for that
peer, the first success closes it. The condition is advisory on the reporting node
(``info``): a peer it cannot reach may be the one at fault, and only the coordinator,
hearing every node of the job, can tell which (``coordinator.policy``).

A TCP connect is the probe: it crosses the same routes and filters as the ranks' gloo or
NCCL sockets, needs no privilege (ICMP would need a raw socket), and an accept needs
nothing of the listener but its event loop.

A refused connect is the peer's machine answering that nothing listens on the port: the
path is up, and its agent is away, most often restarting (systemd's ``Restart=``, an
upgrade), which the coordinator's grace covers too. So a peer that refuses says nothing
for ``restart_grace_s`` from its first refusal: an agent back on its port within it was
never a network fault. Refusals that last longer count as failures (a firewall that
rejects, an agent that stays down), with how long they lasted in the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import structlog

from nodeagent.detectors.latch import Change, ConditionLatch
from proto.conditions import ConditionKind, Severity
from proto.events import EventBase, NetPeer
from ringmaster.clock import SYSTEM, Clock

log = structlog.get_logger()


class ProbeListener:
    """Accepts a peer's probe and closes it at once."""

    def __init__(self, host: str, port: int = 0) -> None:
        self.host, self.port = host, port
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen; the bound port (the setting's, or one the kernel chose for 0)."""

        async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

        self._server = await asyncio.start_server(accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(OSError):
                await self._server.wait_closed()


async def listen(host: str, port: int, record: Path) -> tuple[ProbeListener, int]:
    """A listener on ``port``; for 0, on the port ``record`` holds from this agent's
    previous run (the peers named in its jobs' launches keep reaching it), else on one the
    kernel chooses. The port is recorded for the next run."""
    kept = None if port else _kept_port(record)
    candidates = [port] if kept is None else [kept, port]
    failure: OSError | None = None
    for candidate in candidates:
        listener = ProbeListener(host, candidate)
        try:
            bound = await listener.start()
        except OSError as exc:  # the old port taken: a new one, named in the next launch
            failure = exc
            continue
        _keep_port(record, bound)
        return listener, bound
    assert failure is not None
    raise failure


def _kept_port(record: Path) -> int | None:
    try:
        return int(record.read_text())
    except (OSError, ValueError):
        return None


def _keep_port(record: Path, port: int) -> None:
    with contextlib.suppress(OSError):
        record.write_text(f"{port}\n")


async def reach(addr: str, timeout_s: float) -> str | None:
    """Connect to ``addr`` (host:port); None when it accepted, else why not."""
    host, _, port = addr.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except OSError as exc:
        return os.strerror(exc.errno) if exc.errno else str(exc)  # "No route to host"
    except ValueError as exc:
        return f"bad address {addr!r}: {exc}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


Emit = Callable[[EventBase], Awaitable[None]]
REFUSED = os.strerror(errno.ECONNREFUSED)  # what :func:`reach` says of a port nobody listens on


class PeerProber:
    """Probes ``peers()`` (node → host:port) and emits a :class:`NetPeer` for each change;
    a round's conditions are stamped with ``clock``'s wall time."""

    def __init__(
        self,
        node: str,
        peers: Callable[[], Mapping[str, str]],
        emit: Emit,
        *,
        every_s: float = 2.0,
        timeout_s: float = 1.0,
        confirm: int = 2,
        clock: Clock = SYSTEM,
        restart_grace_s: float = 15.0,
    ) -> None:
        self.node, self.peers, self.emit, self.clock = node, peers, emit, clock
        self.every_s, self.timeout_s, self.confirm = every_s, timeout_s, confirm
        self.restart_grace_s = restart_grace_s
        self._latches: dict[str, ConditionLatch] = {}
        self._addrs: dict[str, str] = {}
        self._refused_since: dict[str, float] = {}  # a peer's first refusal in a row

    def _latch(self, peer: str) -> ConditionLatch:
        if peer not in self._latches:
            self._latches[peer] = ConditionLatch(
                ConditionKind.NET_PEER,
                self.node,
                peer,
                severity=Severity.INFO,
                confirm=self.confirm,
                hold_s=0.0,
            )
        return self._latches[peer]

    async def probe_once(self, t: float) -> list[NetPeer]:
        """One round: every peer probed at once; the events of the changes, emitted."""
        peers = {p: a for p, a in self.peers().items() if p != self.node}
        events = [self._forget(p, t) for p in sorted(set(self._latches) - set(peers))]
        names = sorted(peers)
        errors = await asyncio.gather(*(reach(peers[p], self.timeout_s) for p in names))
        for peer, error in zip(names, errors, strict=True):
            self._addrs[peer] = peers[peer]
            latch = self._latch(peer)
            bad, error = self._judge(peer, error, t)
            change = latch.update(bad, t)
            if change is not None:
                events.append(self._event(peer, latch, change, t, error))
        said = [e for e in events if e is not None]
        for event in said:
            await self.emit(event)
        return said

    def _judge(self, peer: str, error: str | None, t: float) -> tuple[bool | None, str | None]:
        """Whether a probe's result is a failure (None: no evidence either way, a peer
        whose agent may be restarting), and the error to report."""
        if error != REFUSED:
            self._refused_since.pop(peer, None)
            return error is not None, error
        since = self._refused_since.setdefault(peer, t)
        if t - since < self.restart_grace_s:
            return None, error
        return (
            True,
            f"{error} for {t - since:.0f} s, past an agent restart's {self.restart_grace_s:g} s",
        )

    def _event(
        self, peer: str, latch: ConditionLatch, change: Change, t: float, error: str | None
    ) -> NetPeer:
        addr = self._addrs[peer]
        if change is Change.RAISED:
            why = f"cannot reach {peer} at {addr}: {error} ({self.confirm} probes in a row)"
        else:
            why = f"reaches {peer} at {addr} again"
        return self._said(peer, addr, latch, change, t, why, error or "")

    def _forget(self, peer: str, t: float) -> NetPeer | None:
        """A peer no job here has any more: its open condition closes (nothing will)."""
        latch = self._latches.pop(peer)
        addr = self._addrs.pop(peer, "")
        self._refused_since.pop(peer, None)
        if not latch.open:
            return None
        why = f"{peer} is no longer a peer of a job here"
        return self._said(peer, addr, latch, Change.CLEARED, t, why, "")

    def _said(
        self,
        peer: str,
        addr: str,
        latch: ConditionLatch,
        change: Change,
        t: float,
        reason: str,
        error: str,
    ) -> NetPeer:
        lost = change is Change.RAISED
        return NetPeer(
            severity=Severity.WARNING if lost else Severity.INFO,
            node=self.node,
            peer=peer,
            addr=addr,
            reachable=not lost,
            failures=self.confirm if lost else 0,
            error=error,
            message=reason,
            condition=latch.record(change, t, reason=reason),
        )

    async def run(self) -> None:
        while True:
            started = self.clock.monotonic()
            try:
                await self.probe_once(self.clock.time())
            except Exception as exc:  # a probe round must never take the agent down
                log.warning("peer probe round failed", error=repr(exc))
            took = self.clock.monotonic() - started
            await asyncio.sleep(max(0.0, self.every_s - took))
