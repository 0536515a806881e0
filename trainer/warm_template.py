"""The template: the warm interpreter the agent starts, which forks the node's spares.

Importing torch, DeepSpeed, torchao and the trainer costs seconds of CPU (4.5 to 5.5 s a
rank on two cores, 40 s of a GPU node's restart). Paid by every spare, at the agent's start
and again after each launch, it cost as much as the cold starts it saved. The template pays
it once: it imports, then forks a spare whenever an agent asks (:class:`Fork`), in
milliseconds; the fork shares the imported pages until it writes them (the garbage
collector's generations are frozen first, so collecting does not copy them all);
``trainer.warm_forks`` makes the forks and records their ends. CUDA is never initialised
here.

One template may serve several agents: those of one machine's local cluster share one
(``coordinatorctl up``), so the machine imports once whatever the number of its simulated
nodes. So it accepts every connection, and answers each request on the connection it came
on, in turn; it forks only from its main thread (a selector, no thread: a fork copies
only the thread that calls it). An agent it did not start asks who it is
(:class:`Identify`): its PID and the environment it imported in, which a rank's must
match in what is read at import time.

A connection that ends (its agent died, or stopped) is forgotten; the restarted agent
connects again, adopting a template it started, as it does spares. No agent connected
for the orphan time ends it; its ranks then are init's, their statuses only what they
record.

A launch makes the template itself the rank: an agent sends one only to the template it
started, while that one is still importing (the agent just started), when no fork can
serve sooner. The imports are not lost with it: once they are done, the template first
forks its successor, which goes on as the template on a new socket the launch names, in a
session of its own, and only then becomes the rank (the process the agent started, so the
agent still waits for it as its child).
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
from collections.abc import Callable
from typing import NoReturn

import msgspec

from proto.warm import (
    READY,
    Fork,
    Forked,
    Identity,
    Preload,
    Preloaded,
    Request,
    WarmLaunch,
)
from ringmaster.procs import environment
from trainer.warm_forks import Forks, listening, threads_besides_main
from trainer.warm_rank import Main, become, orphan_s, refuse, serve_spare

Answer = Forked | Preloaded | Identity


def serve(
    listener: socket.socket,
    main: Main,
    *,
    preload: Callable[[str], None],
    note: str,
) -> NoReturn:
    """Serve agents on ``listener`` (``READY``, then forks, preloads and who it is) until
    one hands a launch, then become that rank and run ``main``; never returns. ``preload``
    imports a script's libraries; ``note``: what the rank's log says of this interpreter."""
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
        self.forks = Forks()
        # each agent's connection, and what it sent past its last full line
        self.conns: dict[socket.socket, bytes] = {}
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
            if not self.conns:
                left = self.alone_since + self.orphan_s - time.monotonic()
                if left <= 0:
                    os._exit(0)  # no agent came back for it: the node is going away
            for key, _ in self.selector.select(left):
                key.data()

    def _listen(self, listener: socket.socket) -> None:
        """Serve agents on ``listener``, none connected yet."""
        self.listener = listener
        self.conns, self.alone_since = {}, time.monotonic()
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
        self.conns[conn] = b""
        self.selector.register(conn, selectors.EVENT_READ, lambda: self._read(conn))

    def _drop(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        conn.close()
        del self.conns[conn]
        if not self.conns:
            self.alone_since = time.monotonic()

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if not data:  # its agent went away: its successor connects anew
            self._drop(conn)
            return
        pending = self.conns[conn] + data
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            self.conns[conn] = pending
            self._handle(conn, line)
            if conn not in self.conns:
                return  # this is a successor now: the old connections are not its own
        self.conns[conn] = pending

    def _handle(self, conn: socket.socket, line: bytes) -> None:
        try:
            request = msgspec.json.decode(line, type=Request)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            refuse(exc)
        if isinstance(request, WarmLaunch):
            self._become(conn, request)
            return  # (the successor goes on)
        answer: Answer
        if isinstance(request, Fork):
            answer = self.forks.fork(request, self._child)
        elif isinstance(request, Preload):
            answer = self._preload(request)
        else:  # Identify
            answer = Identity(pid=os.getpid(), env=environment(os.getpid()))
        with contextlib.suppress(OSError):  # gone meanwhile: its EOF is read next
            conn.sendall(msgspec.json.encode(answer) + b"\n")

    def _become(self, conn: socket.socket, launch: WarmLaunch) -> None:
        """Become the rank ``launch`` describes (its successor forked first, if it names
        one); returns only in the successor."""
        if launch.successor:
            successor = self._succeed(launch.successor)
            if successor is None:
                return  # this is the successor: the template from now on
            with contextlib.suppress(OSError):
                conn.sendall(msgspec.json.encode(successor) + b"\n")
        self._forget(keep=conn)
        become(conn, self.listener, launch, self.main, ready=self.ready, note=self.note)

    def _preload(self, request: Preload) -> Preloaded:
        begun = time.monotonic()
        self.preload(request.script)
        gc.freeze()
        return Preloaded(script=request.script, imports_s=round(time.monotonic() - begun, 3))

    def _succeed(self, path: str) -> Forked | None:
        """Fork the template that goes on once this one becomes a rank, listening at
        ``path``: its PID here (or why there is none); None in the fork itself, which has
        dropped the agents' connections and the old socket (the agent connects anew)."""
        if threads := threads_besides_main():
            return Forked(threads=threads)
        try:
            listener = listening(path)
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
        for conn in self.conns:
            conn.close()
        self.forks.forget()  # (the agent hands a launch to none that forked)
        self._listen(listener)
        return None

    def _child(self, listener: socket.socket, record_w: int) -> NoReturn:
        """In the fork: a spare of its own session, nothing of the template's kept."""
        os.setsid()
        self._forget()
        self.listener.close()
        if (np_random := sys.modules.get("numpy.random")) is not None:
            np_random.seed()  # a cold rank seeds numpy's global generator afresh
        serve_spare(listener, self.main, record_fd=record_w)

    def _forget(self, keep: socket.socket | None = None) -> None:
        """Drop what serves the template (the rank or spare this process becomes has its
        own SIGCHLD and wakeup fd: ``ringmaster.rank.termination`` sets one), and every
        agent's connection but ``keep``."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        for fd in self.wakeup:
            os.close(fd)
        self.forks.forget()
        for conn in self.conns:
            if conn is not keep:
                conn.close()
        self.conns = {}

    def _reap(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.wakeup[0], 512)
        self.forks.reap()
