"""The template's forks (``trainer.warm_template``): how one is made, in whose network
namespace, and how its end is recorded.

A fork is only as sound as the state it copies: a lock held by another thread stays held
in the child for ever. So a fork is made only while the template has no thread but its
main one (``/proc/self/task``); one that has answers with its count of threads, and the
agent goes back to starting spares with ``exec``.

A fork is a rank to be, and a rank lives in its node's network namespace: it binds the
node's data address and reaches its peers there. The agents of one machine may share a
template (``coordinatorctl up``), and with ``up --netns`` each agent runs in a namespace of
its own while the template runs in the host's; a fork then enters the asking agent's
namespace (``setns``, root's) before it listens for it, which is what ``ip netns exec``
gives a rank started cold. The socket it listens on is a path on the shared filesystem,
which every namespace reaches.

A fork is the template's child, not the agent's: the template reaps it, and when it had
become a rank (it said so, with its exit record's path, on a pipe kept for it) writes the
status it reaped to that record before reaping it, so the agent reports it as it would a
child's, signal included (``nodeagent.adoption``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from proto.warm import Fork, Forked
from ringmaster.rundir import write_exit
from ringmaster.thread_cpu import task_ids

KILLED = (os.CLD_KILLED, os.CLD_DUMPED)
CLONE_NEWNET = 0x40000000
OWN_NETNS = "/proc/self/ns/net"

# in the fork: serve the agent on the listener, the exit record's path said on the fd
Child = Callable[[socket.socket, int], NoReturn]


class Forks:
    """The template's forks that have not ended: a fork's PID → the pipe it names its
    exit record on."""

    def __init__(self) -> None:
        self.children: dict[int, int] = {}

    def fork(self, request: Fork, child: Child) -> Forked:
        """A spare forked to serve its agent on the socket ``request`` names (bound before
        the answer, so the agent may connect as soon as it reads it), in the agent's
        network namespace; ``child`` runs in it and never returns."""
        if threads := threads_besides_main():
            return Forked(threads=threads)
        try:
            netns = _other_netns(request.netns)
        except OSError as exc:
            return Forked(error=f"network namespace {request.netns}: {exc}")
        try:
            return self._fork(request.socket, netns, child)
        finally:
            if netns is not None:
                os.close(netns)

    def _fork(self, path: str, netns: int | None, child: Child) -> Forked:
        try:
            listener = listening(path)
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
                try:
                    if netns is not None:
                        _enter_netns(netns)
                    child(listener, record_w)
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(1)  # never back into the template's loop
        os.close(record_w)
        os.set_blocking(record_r, False)
        self.children[pid] = record_r
        return Forked(pid=pid)

    def forget(self) -> None:
        """In a process that is no template any more (a fork, a successor, the rank the
        template became): the pipes are not its to read."""
        for fd in self.children.values():
            os.close(fd)
        self.children.clear()

    def reap(self) -> None:
        """Reap every fork that ended; one that was a rank gets its status in its exit
        record first, while it is still a zombie (the agent reads the record once the
        zombie is gone, ``nodeagent.adoption``)."""
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


def threads_besides_main() -> int:
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


def listening(path: str) -> socket.socket:
    """A Unix socket listening at ``path``, for a fork to serve the agent on."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(1)
    except OSError:
        listener.close()
        raise
    return listener


def _other_netns(path: str) -> int | None:
    """The network namespace at ``path`` opened, when it is not the template's own (an
    agent of a namespaced node); None when it is, or none is named."""
    if not path:
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    theirs, ours = os.fstat(fd), Path(OWN_NETNS).stat()
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        os.close(fd)
        return None
    return fd


def _enter_netns(fd: int) -> None:
    """Move this (single-threaded) process into the network namespace ``fd`` names
    (``os.setns`` is Python 3.12's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")
