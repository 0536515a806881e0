"""Commands from the coordinator: fencing by epoch, then dispatch.

The agent keeps the newest leader epoch it has seen (on disk, so a restarted agent still
fences) and refuses anything older with a ``command.refused`` event: a deposed leader that
has not noticed yet cannot give orders.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import structlog

from nodeagent.supervisor import Supervisor, SupervisorError
from proto.codec import command_decoder
from proto.commands import (
    CheckpointNow,
    CommandBase,
    CommandReply,
    Launch,
    Pause,
    Ping,
    ReservePort,
    Resume,
    ResyncClock,
    Stop,
)
from proto.events import ClockResynced, ClockResyncFailed, CommandRefused, EventBase, Severity
from ringmaster.rundir import epoch_file

log = structlog.get_logger()


class CommandHandler:
    def __init__(
        self,
        node: str,
        run_dir: Path,
        supervisor: Supervisor,
        advertise_addr: str,
        on_event: Callable[[EventBase], Awaitable[None]],
        resync: Callable[[], Awaitable[ClockResynced | ClockResyncFailed]] | None = None,
        started_at: float = 0.0,
    ) -> None:
        self.node = node
        self.started_at = started_at  # the agent process's start, as its beats say it
        self._resync = resync
        self._epoch_file = epoch_file(run_dir)
        self.supervisor = supervisor
        self.advertise_addr = advertise_addr
        self._on_event = on_event
        self.epoch_seen = 0
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.epoch_seen = int(self._epoch_file.read_text().strip())

    async def handle(self, data: bytes) -> CommandReply:
        try:
            cmd = command_decoder.decode(data)
        except msgspec.DecodeError as exc:
            await self._refuse("?", 0, f"invalid command: {exc}")
            return self._reply(False, f"invalid command: {exc}")
        name = str(type(cmd).__struct_config__.tag)
        if cmd.epoch < self.epoch_seen:
            reason = f"stale epoch {cmd.epoch} < {self.epoch_seen} (from {cmd.issued_by or '?'})"
            await self._refuse(name, cmd.epoch, reason, job=cmd.job)
            return self._reply(False, reason)
        self._remember(cmd.epoch)
        try:
            return await self._dispatch(cmd)
        except SupervisorError as exc:
            return self._reply(False, str(exc))
        except Exception as exc:  # the coordinator must get an answer, never a timeout
            log.error("command failed", command=name, error=repr(exc))
            return self._reply(False, f"{name} failed on {self.node}: {exc!r}")

    async def _dispatch(self, cmd: CommandBase) -> CommandReply:
        match cmd:
            case Launch():
                pids = await self.supervisor.launch(cmd)
                return self._reply(True, pids=pids)
            case Pause() | Resume() | CheckpointNow():
                await self.supervisor.control(cmd.job, str(type(cmd).__struct_config__.tag))
                return self._reply(True)
            case Stop(force=force, grace_s=grace, attempt=attempt):
                # a stop of an earlier attempt leaves a later one running: ok all the same
                await self.supervisor.stop(cmd.job, force=force, grace_s=grace, attempt=attempt)
                return self._reply(True)
            case ReservePort():
                return self._reply(True, port=_free_port(self.advertise_addr))
            case Ping():
                return self._reply(True)
            case ResyncClock():
                if self._resync is None:
                    return self._reply(False, "this agent has no clock collector")
                result = await self._resync()
                await self._on_event(result)
                failed = isinstance(result, ClockResyncFailed)
                return self._reply(not failed, result.message if failed else "")
            case _:
                return self._reply(False, f"unsupported command {type(cmd).__name__}")

    def observe_epoch(self, epoch: int) -> None:
        """A leader announced itself: commands older than its epoch are stale from now."""
        if epoch > self.epoch_seen:
            log.info("new leader epoch", epoch=epoch)
            self._remember(epoch)

    def _remember(self, epoch: int) -> None:
        if epoch > self.epoch_seen:
            self.epoch_seen = epoch
            self._epoch_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._epoch_file.with_suffix(".tmp")
            tmp.write_text(str(epoch))
            tmp.replace(self._epoch_file)

    async def _refuse(self, command: str, epoch: int, reason: str, job: str = "") -> None:
        log.warning("command refused", command=command, epoch=epoch, reason=reason)
        await self._on_event(
            CommandRefused(
                node=self.node,
                job=job or None,
                severity=Severity.WARNING,
                command=command,
                epoch=epoch,
                current_epoch=self.epoch_seen,
                reason=reason,
                message=f"refused {command}: {reason}",
            )
        )

    def _reply(self, ok: bool, error: str = "", **fields: object) -> CommandReply:
        return CommandReply(
            ok=ok,
            error=error,
            node=self.node,
            epoch_seen=self.epoch_seen,
            sent_at=time.time(),
            started_at=self.started_at,
            **fields,  # type: ignore[arg-type]
        )


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((addr, 0))
        port: int = probe.getsockname()[1]
        return port
