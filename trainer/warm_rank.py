"""A warm interpreter becoming a rank: the launch line taken, the process made the one
``exec`` would have made (``trainer.warm``).

Two kinds of interpreter become ranks this way: a spare forked from the node's template,
which serves the agent on a socket of its own (:func:`serve_spare`: ``READY``, one launch
line), and the template itself when the agent hands it a launch before its imports were
done (``trainer.warm_template``). Either way the rank gets its environment replaced whole,
its working directory, its log on fds 1 and 2, ``/dev/null`` on fd 0 and its CPUs for
every thread; the interpreter says ``STARTED`` (so the agent knows the hand-over took),
closes its socket (a restarted agent's connection is refused: this is a rank now) and runs
``main``, leaving with its status the way ``python -m trainer.worker`` does (``os._exit``
after flushing). Until the hand-over, whatever is printed goes to the pool's log.

A forked spare is its template's child, not the agent's, so the agent cannot ``wait`` for
its status: once it has its launch, the spare tells the template where the rank's exit
record is (one line on a pipe the template keeps), and the template writes there the
status it reaps, a death by a signal included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import NoReturn

import msgspec

from proto.warm import ORPHAN_S_ENV, READY, STARTED, WarmLaunch
from ringmaster.thread_cpu import task_ids
from trainer.warm_scripts import Main, script_main

ORPHAN_S = 60.0  # how long to wait for a restarted agent (systemd restarts it in seconds)


def orphan_s() -> float:
    return float(os.environ.get(ORPHAN_S_ENV) or ORPHAN_S)


def serve_spare(listener: socket.socket, main: Main, *, record_fd: int) -> NoReturn:
    """A forked spare: serve agents on ``listener`` until one hands a launch, then become
    that rank; ``record_fd``: where to say the rank's exit record. A connection that ends
    without a launch (its agent died) waits for the next agent; none within the orphan
    time (the node is going away) ends it quietly."""
    ready = time.monotonic()
    while True:
        listener.settimeout(orphan_s())
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            os._exit(0)
        conn.settimeout(None)
        line = _launch_line(conn)
        if line is not None:
            break
        conn.close()
    try:
        launch = msgspec.json.decode(line, type=WarmLaunch)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        refuse(exc)
    become(
        conn,
        listener,
        launch,
        main,
        ready=ready,
        note=f"forked from pid {os.getppid()}",
        record_fd=record_fd,
    )


def _launch_line(conn: socket.socket) -> bytes | None:
    """READY to the agent, then its launch line; None when the connection ends first."""
    try:
        conn.sendall(READY)
        with conn.makefile("rb") as stream:
            line = stream.readline()
    except OSError:
        return None
    return line if line.strip() else None


def refuse(exc: Exception) -> NoReturn:
    """A launch this interpreter cannot take: no STARTED, so the agent starts it cold."""
    print(f"trainer.warm: cannot take the launch: {exc}", file=sys.stderr, flush=True)
    os._exit(1)


def become(
    conn: socket.socket,
    listener: socket.socket,
    launch: WarmLaunch,
    main: Main,
    *,
    ready: float,
    note: str,
    record_fd: int | None = None,
) -> NoReturn:
    """Become the rank ``launch`` describes and run ``main`` (or the launch's script) to
    the end; ``ready``: when this interpreter became ready (for the log)."""
    try:
        log_fd = _apply(launch)
    except OSError as exc:
        refuse(exc)
    if record_fd is not None:  # best effort: without it the rank's own record stands
        with contextlib.suppress(OSError):
            os.write(record_fd, os.fsencode(launch.exit_record) + b"\n")
        os.close(record_fd)
    listener.close()  # a restarted agent's connect is refused: this is a rank now
    with contextlib.suppress(OSError):  # an agent gone since its launch: the rank runs on
        conn.sendall(STARTED)
    conn.close()  # the agent's end sees EOF: the hand-over is complete
    _redirect(log_fd)
    print(
        f"trainer.warm: pid {os.getpid()} runs this rank (warm, {note}, "
        f"idle {time.monotonic() - ready:.2f} s)",
        file=sys.stderr,
        flush=True,
    )
    code = _run(script_main(launch.script) if launch.script else main, launch.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _apply(launch: WarmLaunch) -> int:
    """Environment, directory, CPUs; the log opened. Nothing is redirected yet, so a
    failure here still reaches the pool's log."""
    os.environ.clear()  # unsetenv/putenv: C libraries reading getenv see the rank's too
    os.environ.update(launch.env)
    os.chdir(launch.cwd)
    fd = os.open(launch.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    if launch.cpus:
        available = os.sched_getaffinity(0)
        chosen = {c for c in launch.cpus if c in available} or available
        # sched_setaffinity(0) is the calling thread only; imports may have started others

        for tid in task_ids():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, chosen)
    return fd


def _redirect(log_fd: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(devnull)
    os.close(log_fd)


def _run(main: Main, argv: Sequence[str]) -> int:
    """``main``'s status as the interpreter would have made it its exit status."""
    module = sys.modules.get(getattr(main, "__module__", ""))
    sys.argv = [getattr(module, "__file__", None) or sys.argv[0], *argv]
    try:
        return main(list(argv))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # as the interpreter does: die of SIGINT, so the parent sees the signal
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        traceback.print_exc()
        return 1
