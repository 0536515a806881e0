"""SIGTERM handling: leave quickly, with a non-zero status, whatever the rank is doing.

The agent stops ranks with SIGTERM, then SIGKILL. A half-finished step is worth nothing
(resume restarts from the last durable checkpoint, and an in-flight persist is harmless
because ``latest`` moves only after its manifest), so nothing is flushed or saved: the
Python handler runs the registered cleanups (dropping staged copies, which would
otherwise hold RAM in ``/dev/shm``) and exits. Python runs handlers only between
bytecodes of the main thread, and a rank can be stuck in a C++ collective waiting for a
peer that is already gone; so a watchdog thread, woken through ``signal.set_wakeup_fd``,
ends the process after :data:`GRACE_S` if the handler has not run by then.

Whichever way the rank leaves but a SIGKILL, it first writes its exit record
(:func:`record_exit_in`, ``ringmaster.rundir.write_exit``): an agent restarted while the
rank ran is not its parent and cannot wait for its status, so it reads it there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from ringmaster.rundir import write_exit

EXIT_STATUS = 128 + signal.SIGTERM
GRACE_S = 3.0
_wakeup: list[socket.socket] = []  # keeps the socketpair (and its fds) alive
_cleanups: list[Callable[[], None]] = []
_exit_record: list[Path] = []  # where this process leaves its exit status, if anywhere


def record_exit_in(path: Path | None) -> None:
    """Leave this process's exit status in ``path`` as it exits: on SIGTERM here, and
    through :func:`record_exit` otherwise. None: leave none."""
    _exit_record[:] = [path] if path is not None else []


def record_exit(code: int) -> int:
    """Write the exit record for status ``code`` (best effort: the exit goes ahead
    without it, and the agent then reports the status as unknown); returns ``code``."""
    for path in _exit_record:
        with contextlib.suppress(OSError):
            write_exit(path, os.getpid(), code)
    return code


def on_sigterm(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (quick, local work only) before exiting on SIGTERM."""
    _cleanups.append(cleanup)


def _leave() -> None:
    for cleanup in _cleanups:
        with contextlib.suppress(Exception):
            cleanup()
    record_exit(EXIT_STATUS)
    # os._exit, not sys.exit: peers may be gone, and any collective would hang
    os._exit(EXIT_STATUS)


def _exit_now(signum: int, frame: FrameType | None) -> None:
    print("trainer: SIGTERM, exiting", file=sys.stderr, flush=True)
    _leave()


def _watchdog(wakeup: socket.socket) -> None:
    while True:
        data = wakeup.recv(64)
        if not data or signal.SIGTERM in data:
            break
    time.sleep(GRACE_S)
    _leave()


def install() -> None:
    """Make SIGTERM end this process within :data:`GRACE_S` (main thread only)."""
    reader, writer = socket.socketpair()
    _wakeup.extend((reader, writer))
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, _exit_now)
    threading.Thread(target=_watchdog, args=(reader,), name="sigterm-watchdog", daemon=True).start()
