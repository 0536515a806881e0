"""The local channel between a job's rank 0 and its node agent: a Unix stream socket,
one JSON object per line. Rank 0 sends progress (``proto.progress``); the agent sends
control words, which rank 0 broadcasts to every rank at the next step boundary.

Words sent while rank 0 is not connected (starting up, or reconnecting after an agent
restart) wait in order and go out on the next connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import structlog

from proto.codec import encode, progress_decoder
from proto.progress import ControlAction, ControlWord, Progress

log = structlog.get_logger()
ProgressHandler = Callable[[Progress], Awaitable[None]]


class ControlChannel:
    def __init__(self, path: Path, on_progress: ProgressHandler) -> None:
        self.path = path
        self._on_progress = on_progress
        self._server: asyncio.Server | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: list[ControlWord] = []
        self._seq = 0

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def send(self, action: str) -> int:
        """Queue one word; ``action`` is a :class:`ControlAction` or its value (a command's
        tag), anything else a ``ValueError``."""
        word = ControlWord(action=ControlAction(action), seq=self._seq + 1)
        self._seq = word.seq
        self._pending.append(word)
        await self._flush()
        return word.seq

    async def _flush(self) -> None:
        writer = self._writer
        if writer is None:
            return
        try:
            while self._pending:
                writer.write(encode(self._pending[0]) + b"\n")
                await writer.drain()
                self._pending.pop(0)
        except (ConnectionError, RuntimeError):
            self._writer = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = writer
        await self._flush()
        try:
            while line := await reader.readline():
                try:
                    message = progress_decoder.decode(line)
                except msgspec.DecodeError as exc:
                    log.warning("bad progress line from rank 0", error=str(exc))
                    continue
                await self._on_progress(message)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except ValueError as exc:  # a line longer than the stream's limit: drop the peer
            log.warning("progress line too long from rank 0; connection closed", error=str(exc))
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
