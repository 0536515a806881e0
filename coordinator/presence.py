"""A coordinator's presence on the bus, asked by its standbys before they wait out a lease.

Every coordinator answers requests on its own ``alive`` subject over its lease connection.
When its process dies (``kill -9``, a crash, the host gone) the server drops that
connection at once, and a request to the subject comes back "no responders" within a
round trip: the bus's own word that nobody holds the lease any more. A request that times
out (a holder that is starved, or a bus that is slow) or fails otherwise says nothing, and
the lease's TTL decides as before (``coordinator.election``)."""

from __future__ import annotations

import contextlib

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from coordinator.election import HolderGone
from proto import subjects

ALIVE_TIMEOUT_S = 0.25  # a standby's question; an answer later than this says nothing


async def answer(nc: Client, cluster: str, me: str) -> None:
    """Answer on this coordinator's ``alive`` subject for as long as ``nc`` is open."""

    async def alive(msg: Msg) -> None:
        with contextlib.suppress(Exception):  # the asker may be gone already
            await msg.respond(b"")

    await nc.subscribe(subjects.coordinator_alive(cluster, me), cb=alive)


def prober(nc: Client, cluster: str) -> HolderGone:
    """Whether the bus says ``holder``'s process is gone (no connection answers for it)."""

    async def holder_gone(holder: str) -> bool:
        try:
            subject = subjects.coordinator_alive(cluster, subjects.check_token(holder, "id"))
            await nc.request(subject, b"", timeout=ALIVE_TIMEOUT_S)
        except NoRespondersError:
            return True
        except Exception:  # a timeout, a reconnect, a holder id no subject can name
            return False
        return False

    return holder_gone
