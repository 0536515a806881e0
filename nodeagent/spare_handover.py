"""A rank's launch handed to a warm interpreter (``nodeagent.warm_pool``): the launch line,
the ``STARTED`` that says the hand-over took (after a template's word on its successor),
and how long one still importing may take.

A ready interpreter answers in milliseconds; one handed its launch while still importing
(the template, just after the agent started) reads it only once its imports are done, so
it is given twice as long as the node's newest imports took. One that does not answer in
time is wedged, and killed: an interpreter handed a launch is already its rank's process,
so its death is that rank's exit, reported and decided like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec
import structlog

from nodeagent.spare import Spare, close, kill
from proto.codec import encode
from proto.warm import STARTED, Forked, WarmLaunch

log = structlog.get_logger()

HANDOVER_S = 10.0  # a ready interpreter answers in milliseconds; this only bounds a wedged one
# How long an interpreter handed a launch while importing may take to start the rank, before
# any was seen ready, and at most (34 s were seen on 2 cores with five agents starting)
FIRST_IMPORT_WAIT_S = 90.0


def wait_bound(import_s: float | None) -> float:
    """How long an interpreter handed a launch while importing may take to start it: twice
    as long as the newest imports took (``import_s``), at least three hand-overs' bound and
    at most ``FIRST_IMPORT_WAIT_S``."""
    if import_s is None:
        return FIRST_IMPORT_WAIT_S
    return min(FIRST_IMPORT_WAIT_S, max(3 * HANDOVER_S, 2 * import_s))


async def send(spare: Spare, launch: WarmLaunch) -> bool:
    """Hand it the launch line; False (it is killed) when its connection is gone."""
    try:
        spare.writer.write(encode(launch) + b"\n")
        await spare.writer.drain()
    except OSError:
        log.warning("warm interpreter did not take the launch: rank starts cold", pid=spare.pid)
        await kill(spare)
        return False
    return True


async def started(spare: Spare, bound: float) -> bool:
    """Whether, handed a launch, it says STARTED within ``bound`` seconds (after its READY,
    for one still importing); the connection is closed either way."""
    word = b""
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(bound):
            await spare.settled.wait()
            if spare.ready:
                word = await spare.reader.readline()
    close(spare)  # the rank's own log took over; the interpreter closed its end
    return word == STARTED


async def successor(template: Spare, bound: float) -> Forked | None:
    """What a template handed a launch says of its successor (after its READY, once its
    imports are done) within ``bound`` seconds; None if nothing (it is wedged or dead)."""
    with contextlib.suppress(TimeoutError, OSError, msgspec.DecodeError, msgspec.ValidationError):
        async with asyncio.timeout(bound):
            await template.settled.wait()
            if template.ready:
                return msgspec.json.decode(await template.reader.readline(), type=Forked)
    return None


async def hand_over(spare: Spare, launch: WarmLaunch) -> bool:
    """Hand a ready interpreter the launch: whether it started the rank (else it is
    killed, and the rank starts cold)."""
    if not await send(spare, launch):
        return False
    if await started(spare, HANDOVER_S):
        return True
    log.warning("warm interpreter did not take the launch: rank starts cold", pid=spare.pid)
    await kill(spare)
    return False


async def hand_over_later(spare: Spare, bound: float, closing: Callable[[], bool]) -> None:
    """An interpreter handed its launch while importing, already its rank's process:
    killed if it has not started the rank within ``bound`` (unless the agent is
    ``closing()``: ranks outlive it, and it reads its launch on its own)."""
    if await started(spare, bound) or closing():
        return
    log.warning(
        "warm interpreter did not start its rank: killed, its exit is the rank's",
        pid=spare.pid,
        died=not spare.alive(),
        bound_s=round(bound, 1),
    )
    await kill(spare)
