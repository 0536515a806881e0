"""A minimal real node agent for tests: the same socket protocol as
``nodeagent.control_channel``, in a thread, with ways to wait for what rank 0 sends.

It listens on a Unix socket, records every progress message from every connection, and can
send control words to the current connection or drop it (to play an agent restart).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from proto.codec import progress_decoder
from proto.progress import ControlAction, ControlWord, Progress, ProgressBase

P = TypeVar("P", bound=ProgressBase)


class FakeAgent:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[Progress] = []
        self._cond = threading.Condition()
        self._conn: socket.socket | None = None  # the newest connection: control words go there
        self._conns: list[socket.socket] = []
        self._seq = 0
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._server.bind(str(path))
        self._server.listen()
        threading.Thread(target=self._accept, name="fake-agent", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # server closed
            with self._cond:
                self._conn = conn
                self._conns.append(conn)
                self._cond.notify_all()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines, contextlib.suppress(OSError):
            for line in lines:
                try:
                    message = progress_decoder.decode(line)
                except msgspec.DecodeError:
                    continue  # a torn last line from a dropped connection
                with self._cond:
                    self.messages.append(message)
                    self._cond.notify_all()

    def send(self, action: ControlAction) -> None:
        """Send a control word to the connected rank 0 (waits up to 30 s for it to connect)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._conn is not None, 30):
                raise TimeoutError("rank 0 never connected")
            self._seq += 1
            assert self._conn is not None
            self._conn.sendall(
                msgspec.json.encode(ControlWord(action=ControlAction(action), seq=self._seq))
                + b"\n"
            )

    def wait_for(
        self, kind: type[P], where: Callable[[P], bool] | None = None, timeout: float = 60.0
    ) -> P:
        """The first message of type ``kind`` (and matching ``where``), already received or
        arriving within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for message in self.messages:
                    if isinstance(message, kind) and (where is None or where(message)):
                        return message
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {kind.__name__} arrived; last: {self.messages[-3:]}")
                self._cond.wait(left)

    def of(self, kind: type[P]) -> list[P]:
        """Every message of type ``kind`` received so far."""
        with self._cond:
            return [m for m in self.messages if isinstance(m, kind)]

    def drop_connection(self) -> None:
        """Close the current connection, as an agent restart would (rank 0 reconnects)."""
        with self._cond:
            if self._conn is not None:
                _hang_up(self._conn)
                self._conn = None

    def close(self) -> None:
        """Stop listening first, so rank 0 cannot reconnect to this agent, then hang up."""
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        self._server.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with self._cond:
            for conn in self._conns:
                _hang_up(conn)
            self._conn = None


def _hang_up(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    conn.close()
