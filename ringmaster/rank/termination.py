"""SIGTERM: leave at once when the node agent stops the rank; otherwise it is a notice —
the host shutting down, a scheduler's preemption, ``kill`` by hand — and the rank first
checkpoints at the next step boundary every rank agrees on.

**The agent's stop.** The agent stops ranks with SIGTERM, then SIGKILL, and marks the job
directory first (:func:`ringmaster.rundir.stopping_beside`). A half-finished step is worth
nothing then (a peer may be dead, resume restarts from the newest checkpoint, and an
in-flight persist is harmless because ``latest`` moves only after its manifest), so
nothing is saved: the handler runs the registered cleanups (dropping staged copies, which
would otherwise hold RAM in ``/dev/shm``) and exits.

**A notice.** Any other SIGTERM — and, inside a Slurm allocation (``SLURM_JOB_ID`` set),
SIGUSR1, Slurm's warning before the job's end (``sbatch --signal=USR1@90``) — once a loop
agrees on notices at its step boundaries (:func:`honour_notices`; before that a SIGTERM
exits at once, and Slurm's warning waits for the first boundary), sets the notice
(:func:`noticed`); the step boundary's decision carries every rank's flag, so all ranks
checkpoint at the same step, and the rank then leaves (:func:`leave`) with the same
status. A handler that was installed before (a framework's) is called too, never replaced.
If the rank reaches no boundary within :data:`NOTICE_GRACE_S`
(``RINGMASTER_NOTICE_GRACE_S``) — a long evaluation, a collective whose peer is gone — it
leaves without the checkpoint before the sender's SIGKILL.

Python runs handlers only between bytecodes of the main thread, and a rank can be stuck in
a C++ collective; so a watchdog thread, woken through ``signal.set_wakeup_fd``, ends the
process after :data:`GRACE_S` (the agent's stop) or the notice's grace if nothing else has.

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
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from ringmaster import rank_env
from ringmaster.rundir import stopping_beside, write_exit

EXIT_STATUS = 128 + signal.SIGTERM
GRACE_S = 3.0
NOTICE_GRACE_S = 20.0  # default; RINGMASTER_NOTICE_GRACE_S overrides
_wakeup: list[socket.socket] = []  # keeps the socketpair (and its fds) alive
_cleanups: list[Callable[[], None]] = []
_exit_record: list[Path] = []  # where this process leaves its exit status, if anywhere
_stopping: list[Path] = []  # the agent's stop mark, when an agent started this rank
_notice: list[float] = []  # when the notice came (monotonic), once
_chained: dict[int, Callable[[int, FrameType | None], Any]] = {}
_grace: list[float] = [NOTICE_GRACE_S]
_boundaries: list[bool] = []  # a loop agrees on notices at its step boundaries
_handling: list[bool] = []
_signals: list[signal.Signals] = [
    signal.SIGTERM
]  # the signals taken over  # inside the handler (a chained handler may call back)


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


def honour_notices() -> None:
    """This process has a loop whose step boundaries carry notices: from now on a
    SIGTERM that is not the agent's is honoured at the next boundary (before, it exits)."""
    _boundaries[:] = [True]


def noticed() -> bool:
    """Whether a notice (a SIGTERM not from the agent) came: checkpoint, then leave."""
    return bool(_notice)


def leave() -> None:
    """Exit with the SIGTERM status, after the cleanups and the exit record."""
    for cleanup in _cleanups:
        with contextlib.suppress(Exception):
            cleanup()
    record_exit(EXIT_STATUS)
    # os._exit, not sys.exit: peers may be gone, and any collective would hang
    os._exit(EXIT_STATUS)


def _agent_stopping() -> bool:
    return any(path.exists() for path in _stopping)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _handling:
        return  # a framework's handler chained back to this one: once per signal
    _handling.append(True)
    try:
        _handle(signum, frame)
    finally:
        _handling.clear()


def _handle(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if signum == signal.SIGTERM and (_agent_stopping() or not _boundaries):
        who = "from the agent" if _boundaries else "before any step boundary"
        print(f"trainer: SIGTERM {who}, exiting", file=sys.stderr, flush=True)
        leave()
    if not _notice:
        _notice.append(time.monotonic())
        print(
            f"trainer: {name}: a checkpoint at the next step boundary, then exit "
            f"(within {_grace[0]:g} s)",
            file=sys.stderr,
            flush=True,
        )
    previous = _chained.get(signum)
    if previous is not None:
        previous(signum, frame)


def _watchdog(wakeup: socket.socket) -> None:
    while True:
        data = wakeup.recv(64)
        if not data:
            return
        if any(int(sig) in data for sig in _signals):
            break
    time.sleep(GRACE_S)
    while not _boundaries and not _agent_stopping():
        time.sleep(0.1)  # Slurm's warning before the loop began: its grace starts with it
    if not _agent_stopping():
        # a notice: the boundary's checkpoint leaves by itself; this is the backstop
        time.sleep(max(0.0, _grace[0] - GRACE_S))
        print("trainer: no step boundary within the notice's grace, exiting", file=sys.stderr)
    leave()


def install(env: Mapping[str, str] | None = None) -> None:
    """Take SIGTERM over (main thread only): the agent's stop exits within :data:`GRACE_S`,
    a notice is honoured at the next step boundary. A handler already installed for it
    (a framework's) is kept and called after ours; calling this again re-takes SIGTERM
    from a framework that installed its own since, chaining to it."""
    env = os.environ if env is None else env
    spec = env.get(rank_env.JOB_SPEC)
    _stopping[:] = [stopping_beside(Path(spec))] if spec else []
    with contextlib.suppress(ValueError):
        _grace[0] = float(env.get(NOTICE_GRACE_ENV, NOTICE_GRACE_S))
    _signals[:] = [signal.SIGTERM, *([signal.SIGUSR1] if SLURM_JOB in env else [])]
    for signum in _signals:
        current = signal.getsignal(signum)
        if current is _on_sigterm:
            continue
        if callable(current):
            _chained[signum] = current
        signal.signal(signum, _on_sigterm)
    if _wakeup:
        return
    reader, writer = socket.socketpair()
    _wakeup.extend((reader, writer))
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_watchdog, args=(reader,), name="sigterm-watchdog", daemon=True).start()


NOTICE_GRACE_ENV = "RINGMASTER_NOTICE_GRACE_S"
SLURM_JOB = "SLURM_JOB_ID"  # set inside a Slurm allocation: SIGUSR1 is a notice too
