"""Rank 0's side of the node-agent channel: progress out, control words in.

One JSON object a line over a Unix stream socket (``proto.progress``). Training must never
wait on, or die with, the agent: :meth:`AgentLink.send` only appends to a bounded outbox,
and one background thread connects (retrying with jittered backoff while the agent is away
or restarting), writes the outbox in order and starts a reader per connection that queues the
control words it receives. Messages queued while disconnected go out on the next
connection; if the agent stays away long enough to fill the outbox, the oldest are dropped
(a later StepDone supersedes them anyway).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path

import msgspec

from proto.progress import ControlAction, ControlWord, Progress
from ringmaster.retry import retrying

OUTBOX_LIMIT = 1024
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
_SEND_TIMEOUT_S = 5.0


class AgentLink:
    def __init__(self, path: Path, job: str) -> None:
        self.path = path
        self.job = job
        self.controls: queue.SimpleQueue[ControlWord] = queue.SimpleQueue()
        self._outbox: deque[bytes] = deque(maxlen=OUTBOX_LIMIT)
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(ControlWord)
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agent-link", daemon=True)
        self.connections = 0  # how many times a connection was made (for logs and tests)
        # checkpoint and stop words received and not yet carried out (a phase's watch
        # honours them before the next boundary: ringmaster.rank.phase_watch)
        self._asked: dict[ControlAction, int] = {}  # the newest word's seq
        self._asked_lock = threading.Lock()

    def start(self) -> AgentLink:
        self._thread.start()
        return self

    def send(self, message: Progress) -> None:
        """Queue ``message`` (stamped with the job id and time); never blocks."""
        message.job = self.job
        message.time = time.time()
        self._outbox.append(self._encoder.encode(message) + b"\n")
        self._wake.set()

    def drain(self) -> list[ControlWord]:
        """Control words received since the last call, oldest first."""
        words = []
        with contextlib.suppress(queue.Empty):
            while True:
                words.append(self.controls.get_nowait())
        return words

    def asked(self) -> dict[ControlAction, int]:
        """The checkpoint and stop words that came and were not yet carried out, with the
        newest one's seq."""
        with self._asked_lock:
            return dict(self._asked)

    def acted(self, action: ControlAction) -> None:
        """``action`` (a checkpoint or a stop) was carried out."""
        with self._asked_lock:
            self._asked.pop(action, None)

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Stop the link, first trying for ``flush_timeout_s`` to deliver what is queued."""
        self._closing.set()
        self._wake.set()
        self._thread.join(flush_timeout_s)

    # -- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not (self._closing.is_set() and not self._outbox):
            sock = self._connect()
            if sock is None:
                return  # closing, and no agent to flush to
            self.connections += 1
            dead = threading.Event()
            threading.Thread(
                target=self._read, args=(sock, dead), name="agent-link-reader", daemon=True
            ).start()
            try:
                self._write(sock, dead)
            finally:
                dead.set()
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
                sock.close()

    def _connect(self) -> socket.socket | None:
        """A connection, retried with the shared jittered backoff while the agent is away
        (every rank 0 of a node comes back at once after the agent restarts); None once
        the link is closing and the agent still is not there. Closing cuts a wait short."""
        try:
            return retrying(
                (OSError,),
                first_s=_BACKOFF_MIN_S,
                cap_s=_BACKOFF_MAX_S,
                give_up=self._closing.is_set,
                sleep=self._pause,
            )(self._dial)
        except OSError:
            return None

    def _pause(self, seconds: float) -> None:
        self._closing.wait(seconds)

    def _dial(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            raise
        sock.settimeout(_SEND_TIMEOUT_S)
        return sock

    def _write(self, sock: socket.socket, dead: threading.Event) -> None:
        """Write the outbox until the connection dies or the link closes with it empty."""
        while not dead.is_set():
            try:
                line = self._outbox.popleft()
            except IndexError:
                if self._closing.is_set():
                    return
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                sock.sendall(line)
            except OSError:
                self._outbox.appendleft(line)  # retried on the next connection
                return

    def _read(self, sock: socket.socket, dead: threading.Event) -> None:
        buffer = b""
        while not dead.is_set():
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                try:
                    word = self._decoder.decode(line)
                except msgspec.DecodeError as exc:
                    print(f"agent-link: ignoring bad control line: {exc}", file=sys.stderr)
                    continue
                if word.action in (ControlAction.CHECKPOINT, ControlAction.STOP):
                    with self._asked_lock:
                        self._asked[ControlAction(word.action)] = word.seq
                self.controls.put(word)
        dead.set()
        self._wake.set()
