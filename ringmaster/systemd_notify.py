"""systemd's notify protocol without libsystemd: datagrams to ``$NOTIFY_SOCKET``.

``Type=notify`` units learn that the daemon is up from ``READY=1`` (sent once it is
connected and serving, not merely started), show ``STATUS=`` lines in ``systemctl status``,
and with ``WatchdogSec=`` restart it when ``WATCHDOG=1`` stops coming. The pings come from a
task on the daemon's event loop, so a wedged loop stops them and systemd restarts the
daemon. ``$NOTIFY_SOCKET`` is a path, or an abstract socket written with a leading ``@``.
Outside systemd (no ``$NOTIFY_SOCKET``) every call does nothing. Sends never block: a
datagram socket queues only a few messages, and a daemon stuck on a full queue would stop
doing its work; a notification that does not fit is dropped and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import structlog

log = structlog.get_logger()


def notify(message: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send one notification; False when not running under systemd or it failed."""
    target = env.get("NOTIFY_SOCKET", "")
    if target.startswith("@"):
        address = "\0" + target[1:]
    elif target.startswith("/"):
        address = target
    else:
        return False  # unset, or a transport we do not speak (vsock)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)  # a reader that falls behind must not stall the daemon
            sock.connect(address)
            sock.send(message.encode())
    except OSError as exc:
        log.warning("systemd notify failed", socket=target, error=str(exc))
        return False
    return True


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Half of ``$WATCHDOG_USEC`` in seconds, if the watchdog is meant for this process."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6 / 2


@contextlib.asynccontextmanager
async def service(
    ready_status: str,
    status: Callable[[], str] | None = None,
    env: Mapping[str, str] = os.environ,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> AsyncIterator[None]:
    """``READY=1`` on entry, watchdog pings (with ``STATUS=`` from ``status``) while
    inside, ``STOPPING=1`` on the way out; ``sleep`` waits between two pings."""
    notify(f"READY=1\nSTATUS={ready_status}", env)
    interval = watchdog_interval(env)
    pinger = asyncio.create_task(_ping(interval, status, env, sleep)) if interval else None
    try:
        yield
    finally:
        notify("STOPPING=1\nSTATUS=stopping", env)
        if pinger is not None:
            pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pinger


async def _ping(
    interval: float,
    status: Callable[[], str] | None,
    env: Mapping[str, str],
    sleep: Callable[[float], Awaitable[None]],
) -> None:
    while True:
        notify("WATCHDOG=1" + (f"\nSTATUS={status()}" if status else ""), env)
        await sleep(interval)
