"""The coordinator's side of the NTP-style clock probe (``proto.node.ClockProbe``/``ClockReply``).

A node agent sends a probe stamped ``t1`` on its clock; the responder replies with ``t2``
(when the probe arrived) and ``t3`` (when the reply leaves), both on the responder's clock.
The agent's probe client (``nodeagent.collectors.clock_peer.PeerClock``) turns the four
times into an offset and an error bound. The responder lives here, not in the agent,
because the coordinator runs it and must not import the agent.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from proto import subjects
from proto.codec import encode
from proto.node import ClockProbe, ClockReply

_probe = msgspec.json.Decoder(ClockProbe)


async def serve(nc: Client, cluster: str, clock: Callable[[], float] = time.time) -> Subscription:
    """Answer clock probes with ``clock`` (this process's wall clock), in a queue group so
    that one coordinator answers each probe however many run."""

    async def answer(msg: Msg) -> None:
        t2 = clock()
        try:
            probe = _probe.decode(msg.data)
        except msgspec.DecodeError:
            return  # not a probe: the sender times out, as it would on a lost message
        await msg.respond(encode(ClockReply(t1=probe.t1, t2=t2, t3=clock())))

    return await nc.subscribe(subjects.clock(cluster), queue="clock", cb=answer)
