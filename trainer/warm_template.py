"""The template: the warm interpreter the agent starts, which forks the node's spares.

Importing torch, DeepSpeed, torchao and the trainer costs seconds of CPU (4.5 to 5.5 s a
rank on two cores, 40 s of a GPU node's restart). Paid by every spare, at the agent's start
and again after each launch, it cost as much as the cold starts it saved. The template pays
it once per agent: it imports, then forks a spare whenever the agent asks (:class:`Fork`),
in milliseconds; the fork shares the imported pages until it writes them (the garbage
collector's generations are frozen first, so collecting does not copy them all).

A fork is only as sound as the state it copies: a lock held by another thread stays held
in the child for ever. So the template forks only while it has no thread but its main one
(``/proc/self/task``; the imports start none, numpy's OpenBLAS pool being kept to one
thread while they run); one that has answers every fork with its count of threads, and the
agent goes back to starting spares with ``exec``. CUDA is never initialised here.

Each fork starts its own session (its PID is its process group's id, as for a rank started
cold) and serves the agent on the socket the request named (``trainer.warm_rank``). It is
the template's child, not the agent's: the template reaps it, and when it had become a rank
(it said so, with its exit record's path, on a pipe kept for it) writes the status it reaped
to that record before reaping it, so the agent reports it as it would a child's, signal
included (``nodeagent.adoption``).

On the agent's connection the template answers each request in turn, and goes back to
accepting when the connection ends (the agent died: the one restarted after it adopts the
template, as it does spares). No agent within the orphan time ends it; its ranks then are
init's, their statuses only what they record.

A launch makes the template itself the rank: the agent sends one only while the template
is still importing (the agent just started), when no fork can serve sooner. The imports
are not lost with it: once they are done, the template first forks its successor, which
goes on as the template on a new socket the launch names, in a session of its own, and
only then becomes the rank (the process the agent started, so the agent still waits for
it as its child).
"""

from __future__ import annotations

import contextlib
import gc
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import msgspec

from proto.warm import READY, Fork, Forked, Preload, Preloaded, Request, WarmLaunch
from ringmaster.rundir import write_exit
from ringmaster.thread_cpu import task_ids
from trainer.warm_rank import Main, become, orphan_s, refuse, serve_spare

KILLED = (os.CLD_KILLED, os.CLD_DUMPED)


def serve(
    listener: socket.socket,
    main: Main,
    *,
    preload: Callable[[str], None],
    note: str,
) -> NoReturn:
    """Serve agents on ``listener`` (``READY``, then forks and preloads) until one hands a
    launch, then become that rank and run ``main``; never returns. ``preload`` imports a
    script's libraries; ``note``: what the rank's log says of this interpreter."""
    gc.freeze()  # what the imports made is never collected: forks share it unwritten
    _Template(listener, main, preload, note).run()


class _Template:
    def __init__(
        self, listener: socket.socket, main: Main, preload: Callable[[str], None], note: str
    ) -> None:
        self.listener = listener
        self.main = main
        self.preload = preload
        self.note = note
        self.ready = time.monotonic()
        self.orphan_s = orphan_s()
        self.children: dict[int, int] = {}  # a fork's PID → the pipe it names its record on
        self.conn: socket.socket | None = None
        self.pending = b""  # what the agent sent past the last full line
        self.alone_since = self.ready  # no agent connected since (the orphan time runs)
        self.selector = selectors.DefaultSelector()
        self.wakeup = os.pipe()

    def run(self) -> NoReturn:
        for fd in self.wakeup:
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wakeup[1], warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears it
        self._listen(self.listener)
        self._reap()  # a child that ended before the handler was set
        while True:
            left = None
            if self.conn is None:
                left = self.alone_since + self.orphan_s - time.monotonic()
                if left <= 0:
                    os._exit(0)  # no agent came back for it: the node is going away
            for key, _ in self.selector.select(left):
                key.data()

    def _listen(self, listener: socket.socket) -> None:
        """Serve agents on ``listener``, none connected yet."""
        self.listener = listener
        self.conn, self.pending, self.alone_since = None, b"", time.monotonic()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.wakeup[0], selectors.EVENT_READ, self._reap)
        self.selector.register(listener, selectors.EVENT_READ, self._accept)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            conn.sendall(READY)
        except OSError:
            conn.close()
            return
        self.conn, self.pending = conn, b""
        self.selector.unregister(self.listener)  # one agent at a time
        self.selector.register(conn, selectors.EVENT_READ, self._read)

    def _read(self) -> None:
        assert self.conn is not None
        try:
            data = self.conn.recv(65536)
        except OSError:
            data = b""
        if not data:  # the agent went away: wait for its successor
            self.selector.unregister(self.conn)
            self.conn.close()
            self.conn = None
            self.alone_since = time.monotonic()
            self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
            return
        self.pending += data
        while self.conn is not None and b"\n" in self.pending:
            line, _, self.pending = self.pending.partition(b"\n")
            self._handle(self.conn, line)

    def _handle(self, conn: socket.socket, line: bytes) -> None:
        try:
            request = msgspec.json.decode(line, type=Request)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            refuse(exc)
        if isinstance(request, WarmLaunch):
            if request.successor:
                successor = self._succeed(request.successor)
                if successor is None:
                    return  # this is the successor: the template from now on
                with contextlib.suppress(OSError):
                    conn.sendall(msgspec.json.encode(successor) + b"\n")
            self._forget()
            become(conn, self.listener, request, self.main, ready=self.ready, note=self.note)
        answer: Forked | Preloaded = (
            self._fork(request) if isinstance(request, Fork) else self._preload(request)
        )
        with contextlib.suppress(OSError):  # gone meanwhile: its EOF is read next
            conn.sendall(msgspec.json.encode(answer) + b"\n")

    def _preload(self, request: Preload) -> Preloaded:
        begun = time.monotonic()
        self.preload(request.script)
        gc.freeze()
        return Preloaded(script=request.script, imports_s=round(time.monotonic() - begun, 3))

    def _fork(self, request: Fork) -> Forked:
        if threads := _threads():
            return Forked(threads=threads)
        try:
            listener = _listening(request.socket)
        except OSError as exc:
            return Forked(error=str(exc))
        with listener:
            try:
                record_r, record_w = os.pipe()
            except OSError as exc:
                return Forked(error=str(exc))
            try:
                pid = os.fork()
            except OSError as exc:
                os.close(record_r)
                os.close(record_w)
                return Forked(error=str(exc))
            if pid == 0:
                self._child(listener, record_w)
        os.close(record_w)
        os.set_blocking(record_r, False)
        self.children[pid] = record_r
        return Forked(pid=pid)

    def _succeed(self, path: str) -> Forked | None:
        """Fork the template that goes on once this one becomes a rank, listening at
        ``path``: its PID here (or why there is none); None in the fork itself, which has
        dropped the agent's connection and the old socket (the agent connects anew)."""
        if threads := _threads():
            return Forked(threads=threads)
        try:
            listener = _listening(path)
        except OSError as exc:
            return Forked(error=str(exc))
        try:
            pid = os.fork()
        except OSError as exc:
            listener.close()
            return Forked(error=str(exc))
        if pid:
            listener.close()
            return Forked(pid=pid)
        os.setsid()
        self.selector.close()
        self.listener.close()
        if self.conn is not None:
            self.conn.close()
        for fd in self.children.values():  # (the agent hands a launch to none that forked)
            os.close(fd)
        self.children.clear()
        self._listen(listener)
        return None

    def _child(self, listener: socket.socket, record_w: int) -> NoReturn:
        """In the fork: a spare of its own session, nothing of the template's kept."""
        try:
            os.setsid()
            self._forget()
            self.listener.close()
            if self.conn is not None:
                self.conn.close()
            if (np_random := sys.modules.get("numpy.random")) is not None:
                np_random.seed()  # a cold rank seeds numpy's global generator afresh
            serve_spare(listener, self.main, record_fd=record_w)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(1)  # never back into the template's loop

    def _forget(self) -> None:
        """Drop what serves the template (the rank or spare this process becomes has its
        own SIGCHLD and wakeup fd: ``ringmaster.rank.termination`` sets one)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        for fd in (*self.wakeup, *self.children.values()):
            os.close(fd)
        self.children.clear()

    def _reap(self) -> None:
        """Reap every fork that ended; one that was a rank gets its status in its exit
        record first, while it is still a zombie (the agent reads the record once the
        zombie is gone, ``nodeagent.adoption``)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.wakeup[0], 512)
        while True:
            try:
                ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if ended is None:
                return
            pid = ended.si_pid
            code = -ended.si_status if ended.si_code in KILLED else ended.si_status
            pipe = self.children.pop(pid, None)
            if pipe is not None:
                record = b""
                with contextlib.suppress(OSError):
                    record = os.read(pipe, 65536).strip()
                os.close(pipe)
                if record:
                    with contextlib.suppress(OSError):
                        write_exit(Path(os.fsdecode(record)), pid, code)
            os.waitpid(pid, 0)


def _threads() -> int:
    """This process's threads besides its main one (said in the pool's log: none is forked
    while there are any)."""

    if threads := len(task_ids()) - 1:
        print(
            f"trainer.warm: template pid {os.getpid()} has {threads} thread(s) besides its "
            "main one: it forks nothing",
            file=sys.stderr,
            flush=True,
        )
    return threads


def _listening(path: str) -> socket.socket:
    """A Unix socket listening at ``path``, for a fork to serve the agent on."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(1)
    except OSError:
        listener.close()
        raise
    return listener
