"""Spare rank interpreters, started ahead of need, so a rank (re)start skips the cold
Python start and the imports of torch, DeepSpeed and torchao — the built-in trainer's
ranks, and a user's entry script's (a spare runs the script as ``__main__``; once a job of
that script ran on the node, the spares started after it also import the libraries it
imports, :attr:`WarmPool.preload`).

Each spare is ``python -m trainer.warm`` in its own session (so, once it is a rank, its
PID is its process group's id, as for a rank started cold), listening on a Unix socket the
pool bound for it (``proto.warm``): it imports the training stack, then answers the pool's
connection with ``READY`` and waits for one launch line (``proto.warm.WarmLaunch``).
:meth:`WarmPool.take` hands a ready spare its launch, waits for its ``STARTED`` and
returns it as the rank's process; a replacement is started after
``refill_delay_s`` (on a node with few cores the replacement's imports would otherwise
compete with the ranks starting at that very moment). A launch that finds its spare still
importing hands it the launch at once and takes it as the rank's process: a cold start
would repeat those same imports from the beginning, beside the spare's, so it is never the
faster, and the launch is answered without waiting for imports. A spare that has not
started its rank within :meth:`WarmPool.wait_bound` is wedged: it is killed, and its
rank's exit is reported as any rank's.

The pool fails no launch itself: without a spare, when a ready spare's hand-over does
not take, or when the rank's environment differs from the spare's in a setting read at
import time (:func:`import_time_difference`), ``take`` returns None and the caller starts
the rank cold. A spare that dies before it is ready is not replaced until the next
``take`` asks, so a broken install costs one failed start per launch, not a loop (one
that dies after it was handed a launch is that rank's exit). Spares are killed when the
agent shuts down (ranks are not: they outlive the agent, and so does a spare already
handed its launch, which reads it on its own).

Spares outlive an agent that dies (a crash, ``kill -9``): their sockets are named in the
run directory by PID, start time and a stamp of the code they imported
(``ringmaster.rundir.spare_dir``), and the restarted agent adopts them
(:meth:`WarmPool.adopt`) before starting any, so a rank failing right after an agent
restart is not left waiting for a new spare's imports. A spare of other code (the agent
restarted after an upgrade) is killed, not adopted; one no agent connects to again exits
on its own (``trainer.warm.ORPHAN_S``).

The agent never imports the trainer: a spare is a process, like a rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from nodeagent.adoption import RankProcess
from nodeagent.spare import Spare, close, import_time_difference, kill
from nodeagent.spare_adoption import code_stamp, predecessors_spares
from proto.codec import encode
from proto.warm import LISTEN_FD_ENV, ORPHAN_S_ENV, PRELOAD_ENV, READY, STARTED, WarmLaunch
from ringmaster.procs import start_time
from ringmaster.rundir import spare_dir, spare_socket, warm_pool_log

log = structlog.get_logger()

SPARE = (sys.executable, "-m", "trainer.warm")
HANDOVER_S = 10.0  # a ready spare answers in milliseconds; this only bounds a wedged one
# How long a spare handed a launch while importing may take to start the rank, before any
# spare was seen ready, and at most (34 s were seen on 2 cores with five agents starting)
FIRST_IMPORT_WAIT_S = 90.0


@dataclass
class WarmPool:
    size: int
    run_dir: Path
    command: Sequence[str] = SPARE
    refill_delay_s: float = 0.0
    orphan_s: float | None = None  # a spare's wait for a restarted agent (None: its own)
    spares: list[Spare] = field(default_factory=list)
    _starting: int = 0
    import_s: float | None = None  # how long the newest ready spare took to import
    # a spare's imports keep about one core busy: on a node with few cores several at once
    # each take longer, and the first launch would wait for all of them
    imports_at_once: int = field(default_factory=lambda: max(1, (os.cpu_count() or 1) // 4))
    _tasks: set[asyncio.Task[object]] = field(default_factory=set)
    _closed: bool = False
    # a user's entry script the spares started from now on also import the libraries of
    # (``trainer.warm.preload_script``): the node's newest entry job's
    preload: str = ""

    @property
    def log_path(self) -> Path:
        return warm_pool_log(self.run_dir)

    def resize(self, size: int) -> None:
        """Keep ``size`` spares: start the missing ones in the background, kill any over."""
        if self._closed or (size == self.size and len(self.spares) <= size):
            return  # (adopted spares may be over a size that did not change)
        self.size = size
        surplus = len(self.spares) - size
        if surplus > 0:
            # the youngest first: the oldest are the likeliest to be ready
            extra, self.spares = self.spares[size:], self.spares[:size]
            for spare in extra:
                self._background(kill(spare))
        self._background(self._top_up())

    async def adopt(self) -> int:
        """Take over the spares the agent before this one left running; how many. Call it
        before :meth:`resize`, so none is started that an adopted one would stand for."""
        stamp = code_stamp(self.command)
        for found, env, reader, writer in await predecessors_spares(self.run_dir, stamp):
            spare = Spare(found.pid, found.started, env, reader, writer, found.path)
            self.spares.append(spare)
            self._background(self._await_ready(spare))
        if self.spares:
            log.info("warm interpreters adopted", pids=[s.pid for s in self.spares])
        return len(self.spares)

    def ready(self) -> int:
        return sum(1 for s in self.spares if s.ready and s.alive())

    async def take(self, launch: WarmLaunch, *, job: str, exit_record: Path) -> RankProcess | None:
        """A spare turned into the rank ``launch`` describes, or None: start it cold. A
        spare still importing is handed the launch at once and returned as the rank: it
        reads the launch once its imports are done (:meth:`_hand_over_later`).
        ``exit_record``: where the rank leaves its status (read for an adopted spare)."""
        if self.size == 0:
            return None  # the pool is off
        self._prune()
        spare = next((s for s in self.spares if s.ready), None) or next(iter(self.spares), None)
        if spare is None:
            log.info("no warm interpreter: rank starts cold")
            self._refill()
            return None
        if (name := import_time_difference(spare.env, launch.env)) is not None:
            log.info("rank environment differs at import time: rank starts cold", variable=name)
            return None
        self.spares.remove(spare)
        spare.socket.unlink(missing_ok=True)  # a rank from now on: no agent may adopt it
        self._refill()
        try:
            spare.writer.write(encode(launch) + b"\n")
            await spare.writer.drain()
        except OSError:
            log.warning("warm interpreter did not take the launch: rank starts cold", pid=spare.pid)
            await kill(spare)
            return None
        rank = spare.as_rank(job, exit_record)
        if not spare.ready:
            self._background(self._hand_over_later(spare))
            return rank
        word = b""
        with contextlib.suppress(OSError, TimeoutError):
            word = await asyncio.wait_for(spare.reader.readline(), HANDOVER_S)
        if word != STARTED:
            log.warning("warm interpreter did not take the launch: rank starts cold", pid=spare.pid)
            await kill(spare)
            return None
        close(spare)  # the rank's own log took over; the spare closed its end
        return rank

    def wait_bound(self) -> float:
        """How long a spare handed a launch while importing may take to start it: twice
        as long as the newest spare's imports took, at least three hand-overs' bound and
        at most ``FIRST_IMPORT_WAIT_S``."""
        if self.import_s is None:
            return FIRST_IMPORT_WAIT_S
        return min(FIRST_IMPORT_WAIT_S, max(3 * HANDOVER_S, 2 * self.import_s))

    async def _hand_over_later(self, spare: Spare) -> None:
        """A spare already is its rank's process; one that has not started the rank
        within :meth:`wait_bound` is wedged and killed: its rank exits, and is reported
        like any rank's exit. The agent's own shutdown leaves it be (ranks outlive the
        agent, and it reads its launch on its own)."""
        bound = self.wait_bound()
        log.info(
            "warm interpreter still importing: it starts the rank when ready",
            pid=spare.pid,
            importing_s=round(time.monotonic() - spare.born, 2),
            bound_s=round(bound, 1),
        )
        word = b""
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(bound):
                await spare.settled.wait()
                if spare.ready:
                    word = await spare.reader.readline()
        if self._closed:
            return
        if word == STARTED:
            close(spare)
            return
        log.warning(
            "warm interpreter did not start its rank: killed, its exit is the rank's",
            pid=spare.pid,
            died=not spare.alive(),
            bound_s=round(bound, 1),
        )
        await kill(spare)

    async def close(self) -> None:
        """Kill every spare (not the ranks they became); the pool starts no more."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        spares, self.spares = self.spares, []
        await asyncio.gather(*(kill(s) for s in spares), return_exceptions=True)
        with contextlib.suppress(OSError):  # their sockets went with them; another file stays
            spare_dir(self.run_dir).rmdir()  # (a deep run dir's is in the temp dir)

    def _refill(self) -> None:
        async def later() -> None:
            await asyncio.sleep(self.refill_delay_s)
            await self._top_up()

        self._background(later())

    def _prune(self) -> None:
        """Forget spares that died after they were ready: their places are free again."""
        for spare in [s for s in self.spares if not s.alive()]:
            self.spares.remove(spare)
            self._background(kill(spare))  # reaped, its socket removed

    def _importing(self) -> int:
        return self._starting + sum(1 for s in self.spares if not s.ready)

    async def _top_up(self) -> None:
        """Start missing spares, no more importing at once than ``imports_at_once``; the
        next starts when one is ready."""
        self._prune()
        while (
            not self._closed
            and len(self.spares) + self._starting < self.size
            and self._importing() < self.imports_at_once
        ):
            self._starting += 1
            try:
                spare = await self._spawn()
            finally:
                self._starting -= 1
            if spare is None:
                return
            if self._closed or len(self.spares) >= self.size:  # closed or shrunk meanwhile
                await kill(spare)
                return
            self.spares.append(spare)
            self._background(self._await_ready(spare))

    async def _spawn(self) -> Spare | None:
        """A new spare, listening on a socket bound here and named, once its PID is known,
        where a restarted agent finds it; connected to, its READY to come."""
        env = dict(os.environ)
        directory = spare_dir(self.run_dir)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fresh = directory / f"new-{uuid.uuid4().hex[:12]}.sock"
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.closing(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) as sock:
                sock.bind(str(fresh))
                sock.listen(1)
                spare_env = {**env, LISTEN_FD_ENV: str(sock.fileno())}
                if self.orphan_s is not None:
                    spare_env[ORPHAN_S_ENV] = str(self.orphan_s)
                if self.preload:
                    spare_env[PRELOAD_ENV] = self.preload
                with self.log_path.open("ab") as logf:
                    proc = await asyncio.create_subprocess_exec(
                        *self.command,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=logf,
                        stderr=logf,
                        env=spare_env,
                        pass_fds=(sock.fileno(),),
                        start_new_session=True,
                    )
            started = start_time(proc.pid)
            path = fresh
            if started is not None:
                path = spare_socket(directory, proc.pid, started, code_stamp(self.command))
                fresh.rename(path)
            reader, writer = await asyncio.open_unix_connection(str(path))
        except OSError as exc:
            fresh.unlink(missing_ok=True)
            log.warning("cannot start a warm interpreter", error=str(exc))
            return None
        return Spare(proc.pid, started, env, reader, writer, path, child=proc)

    async def _await_ready(self, spare: Spare) -> None:
        try:
            await self._read_ready(spare)
        finally:
            spare.settled.set()

    async def _read_ready(self, spare: Spare) -> None:
        word = b""
        with contextlib.suppress(OSError):
            word = await spare.reader.readline()
        if word == READY:
            spare.ready = True
            waited = time.monotonic() - spare.born
            if spare.child is not None:  # an adopted one began importing before this agent
                self.import_s = waited
            log.info("warm interpreter ready", pid=spare.pid, import_s=round(waited, 2))
            await self._top_up()
            return
        if spare not in self.spares:
            return  # ended on purpose (resize, close), or a launch waits on it
        # died before it was ready: not replaced until a launch asks (no restart loop)
        self.spares.remove(spare)
        code = await kill(spare)
        log.warning("warm interpreter died before it was ready", code=code, log=str(self.log_path))

    def _background(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
