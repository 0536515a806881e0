"""A template the agents of one machine share (``warm_template_socket``), as an agent joins
it: connected to, waited for, asked who it is.

A template imports the training stack once (4.5 CPU-s here) so that spares are forks, not
imports. One per agent is one per machine in production; but a local cluster runs every
simulated node's agent on one machine, and each importing for itself cost N imports at
every ``coordinatorctl up``, nodes that never run a rank included. So ``up`` starts one
template and every agent of the cluster forks its spares from it.

The pool (``nodeagent.warm_template``) uses it as its own but in three ways: it never
hands it a launch (it is never a rank: the other agents fork from it), never kills it
(dropping the connection is all; whoever started it stops it), and never adopts it (its
socket is not in the agent's run directory). Its forks are this agent's spares like any
other: they listen in this agent's run directory and enter its network namespace
(``trainer.warm_forks``), and the template records the status of one that was a rank for
this agent as for any. A rank starts warm only if its environment matches, in what is
read at import time, the environment the template started with, which it says itself
(``proto.warm.Identity``): nothing else tells this agent what that environment was.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import msgspec

from nodeagent.spare import Spare
from proto.codec import encode
from proto.warm import READY, Identify, Identity
from ringmaster.procs import start_time


async def join(path: Path, bound: float) -> Spare | str:
    """The template listening at ``path``, once it has said READY (after its imports) and
    who it is; else why there is none: nothing listens there, or it ended or said nothing
    within ``bound`` seconds."""
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        async with asyncio.timeout(bound):
            if await reader.readline() != READY:
                raise EOFError("it ended before it was ready")
            writer.write(encode(Identify()) + b"\n")
            await writer.drain()
            identity = msgspec.json.decode(await reader.readline(), type=Identity)
    except (OSError, EOFError, TimeoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()
        return str(exc) or f"no answer within {bound:.0f} s"
    pid = identity.pid
    spare = Spare(pid, start_time(pid), identity.env, reader, writer, path, ready=True, shared=True)
    spare.settled.set()
    return spare


def netns() -> str:
    """This agent's network namespace, as a fork of a shared template enters it."""
    return f"/proc/{os.getpid()}/ns/net"
