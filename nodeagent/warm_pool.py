"""Spare rank interpreters, ready ahead of need, so a rank (re)start skips the cold Python
start and the imports of torch, DeepSpeed and torchao — the built-in trainer's ranks, and
a user's entry script's (run as ``__main__``; once a job of that script ran on the node,
the spares also have the libraries it imports, :attr:`WarmPool.preload`).

The pool starts one ``python -m trainer.warm``, the *template*: it imports once and forks
a spare whenever asked (``nodeagent.warm_template``), in milliseconds. Given the socket of
a template the machine's agents share (``template_socket``: a local cluster's), it forks
from that one instead, and starts its own only when nothing answers there
(``nodeagent.shared_template``). A spare has its own
session (its PID will be its rank's process group's id, as for a rank started cold) and
socket (``proto.warm``): ``READY``, then one launch line. :meth:`WarmPool.take` hands a
ready spare the launch, waits for ``STARTED`` and returns it as the rank's process; a fork
replaces it at once. With none ready, the template forks one for the launch; a template
still importing (the agent just started) is handed the launch itself, answered at once: a
cold start would repeat its imports from the beginning, beside it, so it is never the
faster. It forks its successor, then becomes the rank; one that has not within
:meth:`WarmPool.wait_bound` is wedged, killed, and its exit is the rank's.

A forked rank is the template's child, not the agent's: it is watched as an adopted rank
is (``nodeagent.adoption``), its status, a signal's too, from the exit record the template
writes as it reaps it. A template with threads besides its main one cannot fork safely:
then spares are started with ``exec``, each importing for itself, a few at a time
(``imports_at_once``), a replacement ``refill_delay_s`` after a launch.

The pool fails no launch: without an interpreter, when a hand-over does not take, or when
the rank's environment differs from the interpreters' in a setting read at import time
(:func:`import_time_difference`), ``take`` returns None and the caller starts the rank
cold. A dead template is started again after a backoff, an exec'd spare that died before
it was ready only when a launch asks: a broken install never loops. The template and idle
spares die with the agent's shutdown; ranks do not, nor an interpreter handed its launch.

They outlive an agent that dies (a crash, ``kill -9``): their sockets are named by PID,
start time and a stamp of the code they imported (``ringmaster.rundir.spare_dir``), and
the restarted agent adopts them (:meth:`WarmPool.adopt`) before starting any. Ones of other
code (an upgrade in between) are killed instead; one no agent connects to again exits on
its own (``trainer.warm_rank.ORPHAN_S``). The agent never imports the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog

from nodeagent.adoption import RankProcess
from nodeagent.spare import Spare, import_time_difference, kill, settle, start
from nodeagent.spare_adoption import code_stamp, predecessors_spares
from nodeagent.spare_handover import (
    HANDOVER_S,
    hand_over,
    hand_over_later,
    send,
    wait_bound,
)
from nodeagent.warm_template import Templates
from proto.warm import ORPHAN_S_ENV, PRELOAD_ENV, WarmLaunch
from ringmaster.rundir import spare_dir, warm_pool_log

log = structlog.get_logger()

SPARE = (sys.executable, "-m", "trainer.warm")


@dataclass
class WarmPool:
    size: int
    run_dir: Path
    command: Sequence[str] = SPARE
    refill_delay_s: float = 0.0
    orphan_s: float | None = None  # an interpreter's wait for a restarted agent (None: its own)
    template_socket: Path | None = None  # a shared template's, joined instead of our own
    spares: list[Spare] = field(default_factory=list)  # idle: forked, or exec'd
    _starting: int = 0
    import_s: float | None = None  # how long the newest template (or exec'd spare) imported
    # an exec'd spare's imports keep about one core busy: on a node with few cores several
    # at once each take longer, and the first launch would wait for all of them
    imports_at_once: int = field(default_factory=lambda: max(1, (os.cpu_count() or 1) // 4))
    _tasks: set[asyncio.Task[object]] = field(default_factory=set)
    _closed: bool = False
    # a user's entry script the spares from now on also have the libraries of
    # (``trainer.warm_scripts.preload_script``): the node's newest entry job's
    preload: str = ""
    templates: Templates = field(init=False)

    def __post_init__(self) -> None:
        self.templates = Templates(
            command=self.command,
            directory=spare_dir(self.run_dir),
            log_path=self.log_path,
            env=self._env,
            preload=lambda: self.preload,
            wanted=lambda: not self._closed and self.size > 0,
            on_ready=self._template_ready,
            refill_delay_s=self.refill_delay_s,
            shared=self.template_socket,
        )

    @property
    def log_path(self) -> Path:
        return warm_pool_log(self.run_dir)

    def resize(self, size: int) -> None:
        """Keep ``size`` spares: fork (or start) the missing ones in the background, kill
        any over; with none, the template goes too."""
        over = len(self.spares) > size or (size == 0 and self.templates.current is not None)
        if self._closed or (size == self.size and not over):
            return  # (adopted spares, or a template, may be over a size that did not change)
        self.size = size
        surplus = len(self.spares) - size
        if surplus > 0:
            # the youngest first: the oldest are the likeliest to be ready
            extra, self.spares = self.spares[size:], self.spares[:size]
            for spare in extra:
                self._background(kill(spare))
        if size == 0:
            self._background(self.templates.stop())
        self._background(self._top_up())

    async def adopt(self) -> int:
        """Take over the template and spares the agent before this one left running; how
        many spares. Call it before :meth:`resize`, so none is started that an adopted one
        would stand for."""
        stamp = code_stamp(self.command)
        for found, env, reader, writer in await predecessors_spares(self.run_dir, stamp):
            spare = Spare(found.pid, found.started, env, reader, writer, found.path)
            if not found.template:
                self.spares.append(spare)
                self._background(self._await_ready(spare))
            elif self.templates.current is None:
                self.templates.current, self.templates.stamp = spare, stamp
            else:  # two templates: an agent died as it replaced one
                self._background(kill(spare))
        template = self.templates.current
        if self.spares or template is not None:
            pids = [s.pid for s in self.spares]
            log.info("warm interpreters adopted", pids=pids, template=template and template.pid)
        return len(self.spares)

    def ready(self) -> int:
        return sum(1 for s in self.spares if s.ready and s.alive())

    async def take(self, launch: WarmLaunch, *, job: str, exit_record: Path) -> RankProcess | None:
        """A spare turned into the rank ``launch`` describes, or None: start it cold. One
        still importing is handed the launch at once and returned as the rank: it reads the
        launch once its imports are done (``hand_over_later``). ``exit_record``: where
        the rank's status is left (read for a spare that is not this agent's child)."""
        if self.size == 0:
            return None  # the pool is off
        self._prune()
        spare = self._choose()
        if spare is None:
            log.info("no warm interpreter: rank starts cold")
            self._refill()
            return None
        if (name := import_time_difference(spare.env, launch.env)) is not None:
            log.info("rank environment differs at import time: rank starts cold", variable=name)
            return None
        successor = None
        if spare is self.templates.ready():
            spare = await self.templates.fork(ready=True)
            if spare is None:
                log.info("no spare forked: rank starts cold")
                self._refill()
                return None
        elif spare is self.templates.current:
            successor = self.templates.hand_over()  # still importing: it becomes the rank
        else:
            self.spares.remove(spare)
        spare.socket.unlink(missing_ok=True)  # a rank from now on: no agent may adopt it
        self._refill()
        launch = msgspec.structs.replace(
            launch, exit_record=str(exit_record), successor=str(successor or "")
        )
        if spare.ready:
            return spare.as_rank(job, exit_record) if await hand_over(spare, launch) else None
        if not await send(spare, launch):
            return None
        log.info(
            "warm interpreter still importing: it starts the rank when ready",
            pid=spare.pid,
            importing_s=round(time.monotonic() - spare.born, 2),
            bound_s=round(self.wait_bound(), 1),
        )
        if successor is None:
            self._background(hand_over_later(spare, self.wait_bound(), lambda: self._closed))
        else:
            self._background(self._hand_over_template(spare, successor))
        return spare.as_rank(job, exit_record)

    async def _hand_over_template(self, template: Spare, successor: Path) -> None:
        """The template handed a launch: its successor first, then its STARTED."""
        answered = await self.templates.handed(template, successor, self.wait_bound())
        self._background(self._top_up())  # (exec'd spares, where it had a thread)
        bound = HANDOVER_S if answered else 0.0
        await hand_over_later(template, bound, lambda: self._closed)

    def _choose(self) -> Spare | None:
        """A ready spare; else the ready template (to fork one now: milliseconds); else a
        spare still starting; else the template still importing."""
        return (
            next((s for s in self.spares if s.ready), None)
            or self.templates.ready()
            or next(iter(self.spares), None)
            or self.templates.current
        )

    def wait_bound(self) -> float:
        """How long one handed a launch while importing may take to start it."""
        return wait_bound(self.import_s)

    async def close(self) -> None:
        """Kill the template and every idle spare (not the ranks they became); the pool
        starts no more."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        spares, self.spares = self.spares, []
        await asyncio.gather(*(kill(s) for s in spares), return_exceptions=True)
        await self.templates.stop()
        with contextlib.suppress(OSError):  # their sockets went with them; another file stays
            spare_dir(self.run_dir).rmdir()  # (a deep run dir's is in the temp dir)

    def _env(self) -> dict[str, str]:
        """A new interpreter's environment: the agent's, and what the pool tells it."""
        env = dict(os.environ)
        if self.orphan_s is not None:
            env[ORPHAN_S_ENV] = str(self.orphan_s)
        if self.preload:
            env[PRELOAD_ENV] = self.preload
        return env

    def _exec(self) -> Coroutine[Any, Any, Spare | None]:
        """A spare that imports for itself (where the template may not fork)."""
        directory, stamp = spare_dir(self.run_dir), code_stamp(self.command)
        return start(self.command, directory, stamp, self._env(), self.log_path, template=False)

    def _template_ready(self, import_s: float | None) -> None:
        if import_s is not None:
            self.import_s = import_s
        self._background(self._top_up())

    def _refill(self) -> None:
        """Replace what a launch took: a fork at once; an exec'd spare after the delay."""

        async def later() -> None:
            if not self.templates.forks:
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
        """Fork the missing spares from the template (started first when there is none);
        without templates, start them, no more importing at once than ``imports_at_once``
        (the next starts when one is ready)."""
        self._prune()
        while not self._closed and len(self.spares) + self._starting < self.size:
            if self.templates.forks and self.templates.ready() is None:
                self.templates.keep()  # its READY tops up
                return
            if not self.templates.forks and self._importing() >= self.imports_at_once:
                return
            forking = self.templates.forks
            self._starting += 1
            try:
                spare = await (self.templates.fork() if forking else self._exec())
            finally:
                self._starting -= 1
            if spare is None:
                if forking and not self.templates.forks:
                    continue  # the template may not fork: spares are exec'd from now on
                return
            if self._closed or len(self.spares) >= self.size:  # closed or shrunk meanwhile
                await kill(spare)
                return
            self.spares.append(spare)
            self._background(self._await_ready(spare))

    async def _await_ready(self, spare: Spare) -> None:
        if await settle(spare):
            if spare.child is not None:  # exec'd here: it imported for itself
                self.import_s = time.monotonic() - spare.born
            log.info("warm interpreter ready", pid=spare.pid, forked=spare.child is None)
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
