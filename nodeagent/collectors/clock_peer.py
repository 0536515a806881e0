"""This node's clock offset to the coordinator, measured NTP-style over NATS request/reply.

A probe records its send time ``t1`` on the agent's clock; the responder replies with its
receive and send times ``t2`` and ``t3``; the reply arrives at ``t4``. The agent's offset is
``((t1 - t2) + (t4 - t3)) / 2`` (positive: the agent is ahead) and, whatever the path's
asymmetry, the true offset lies within half the round trip ``(t4 - t1) - (t3 - t2)`` of it.
Of a burst of probes the one with the shortest round trip wins: its bound is the tightest.

The responder is :mod:`ringmaster.clock_responder`; coordinators run it. The agent's side
reads ``clock``: its wall time is what is measured (the clock collector makes it the
node's skewed one on a simulated node), its monotonic time how old a measurement is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.errors import Error as NatsError

from proto import subjects
from proto.codec import encode
from proto.node import ClockProbe, ClockReply
from ringmaster.clock import SYSTEM, Clock

log = structlog.get_logger()
_reply = msgspec.json.Decoder(ClockReply)


class PeerClock:
    def __init__(
        self,
        *,
        interval_s: float = 10.0,
        timeout_s: float = 1.0,
        probes: int = 4,
        clock: Clock = SYSTEM,
    ) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.probes = probes
        self.clock = clock
        self.local_clock: Callable[[], float] = clock.time
        self._target: tuple[Client, str] | None = None
        self._latest: tuple[float, float, float] | None = None  # (monotonic, offset, rtt) s

    @property
    def attached(self) -> bool:
        return self._target is not None

    def latest(self) -> dict[str, Any] | None:
        """The last measurement, unless three intervals old (the coordinator is gone)."""
        if self._latest is None:
            return None
        at, offset, rtt = self._latest
        age = self.clock.monotonic() - at
        if age > 3 * self.interval_s:
            return None
        return {
            "offset_ms": round(offset * 1000, 3),
            "bound_ms": round(rtt * 500, 3),
            "rtt_ms": round(rtt * 1000, 3),
            "age_s": round(age, 1),
        }

    async def run(self, nc: Client, cluster: str) -> None:
        self._target = (nc, subjects.clock(cluster))
        while True:
            await self.measure()
            await asyncio.sleep(self.interval_s)

    def forget(self) -> None:
        """Drop the last measurement (the clock was just stepped: it no longer holds)."""
        self._latest = None

    async def measure(self) -> None:
        if self._target is None:
            return
        nc, subject = self._target
        best: tuple[float, float] | None = None  # (rtt, offset)
        for _ in range(self.probes):
            t1 = self.local_clock()
            try:
                msg = await nc.request(subject, encode(ClockProbe(t1=t1)), timeout=self.timeout_s)
                t4 = self.local_clock()
                reply = _reply.decode(msg.data)
            except (NatsError, TimeoutError, msgspec.DecodeError) as exc:
                log.debug("clock probe failed", error=repr(exc))
                continue
            rtt = max(0.0, (t4 - t1) - (reply.t3 - reply.t2))
            if best is None or rtt < best[0]:
                best = (rtt, ((t1 - reply.t2) + (t4 - reply.t3)) / 2)
        if best is not None:
            self._latest = (self.clock.monotonic(), best[1], best[0])
