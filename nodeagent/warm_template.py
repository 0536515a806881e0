"""The node's template interpreter as the pool sees it (``nodeagent.warm_pool``): started,
adopted or shared, asked for forks and for a script's imports, and kept running.

One ``python -m trainer.warm`` per agent imports the training stack (``trainer.warm``);
every spare after that is a fork of it (``trainer.warm_template``), so a refill costs
milliseconds of CPU instead of the seconds of a fresh interpreter's imports. Where the
agents of a machine share one (``shared``: the local cluster's simulated nodes,
``nodeagent.shared_template``), the pool joins it instead of starting its own; with
nothing answering there, it starts its own after all (said once), so a missing shared
template never costs more than the template it stands for. Requests go one at a time on
the pool's connection to it (:class:`Fork`, :class:`Preload`), each answered with one
line. A template that answers a fork with threads besides its main one never forks: the
pool is told (``forks`` turns False) and starts spares with ``exec`` from then on, as
before templates.

The template is kept while the pool wants spares: one that dies is started again, and one
that dies before it has served :data:`STEADY_S` is retried with the project's backoff
(``ringmaster.retry``), so a broken install costs a start per backoff, never a loop. The
template handed a launch while still importing becomes that rank (``take`` has nothing
sooner to offer), once it has forked its successor: the pool connects to that one on its
new socket and forks from it, no import lost. Without a successor (the template had a
thread, or died) the next one starts ``refill_delay_s`` later, when the ranks starting at
that moment have had the node's cores for their own imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec
import structlog

from nodeagent.shared_template import join, netns
from nodeagent.spare import Spare, connect, kill, settle, start
from nodeagent.spare_adoption import code_stamp
from nodeagent.spare_handover import FIRST_IMPORT_WAIT_S, HANDOVER_S, successor
from proto.warm import Fork, Forked, Preload, Preloaded
from ringmaster.procs import wait_until_async
from ringmaster.retry import retrying_async

log = structlog.get_logger()
T = TypeVar("T", Forked, Preloaded)

PRELOAD_S = 90.0  # a script's libraries take seconds (transformers: 3.5 s of CPU here)
STEADY_S = 60.0  # served this long, a template that dies did not die of its start
RESTART_FIRST_S = 2.0
RESTART_CAP_S = 300.0
POLL_S = 0.5  # how often the template is looked at (an adopted one is nobody's child here)


class TemplateDied(Exception):
    pass


@dataclass
class Templates:
    """The pool's template, and the task that keeps one running while ``wanted()``."""

    command: Sequence[str]
    directory: Path  # where it and its forks listen (``ringmaster.rundir.spare_dir``)
    log_path: Path
    env: Callable[[], Mapping[str, str]]  # a new template's environment
    preload: Callable[[], str]  # the script whose libraries the forks should have
    wanted: Callable[[], bool]
    on_ready: Callable[[float | None], None]  # told its import time (None: adopted)
    refill_delay_s: float = 0.0
    shared: Path | None = None  # the socket of the template this machine's agents share
    current: Spare | None = None
    stamp: str = ""  # the code the template started here imported (its forks' too)
    forks: bool = True  # False once a template had threads: spares are exec'd
    preloaded: str = ""  # the script whose libraries the current template imported
    fell_back: bool = False  # the shared template did not answer once: said so
    _asking: asyncio.Lock = field(default_factory=asyncio.Lock)
    _task: asyncio.Task[None] | None = None
    _succession: asyncio.Future[Spare | None] | None = None  # of the template handed a launch

    def keep(self) -> None:
        """Keep a template running (cheap to call again)."""
        if self.forks and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._keep())

    def ready(self) -> Spare | None:
        return self.current if self.current is not None and self.current.ready else None

    def hand_over(self) -> Path:
        """The current template (still importing) is to become a rank: the pool's no
        longer; where its successor is to listen (:meth:`handed` follows it)."""
        self.current = None
        self._succession = asyncio.get_running_loop().create_future()
        return self.directory / f"new-{uuid.uuid4().hex[:12]}.sock"

    async def handed(self, template: Spare, fresh: Path, bound: float) -> bool:
        """Once ``template``, handed a launch, is done importing: its successor, connected
        to at ``fresh``, is the pool's template (without one, the next is started after
        ``refill_delay_s``). Whether it answered within ``bound`` (its STARTED follows)."""
        new: Spare | None = None
        try:
            forked = await successor(template, bound)
            if forked is not None and forked.threads:
                await self._no_forks(template, forked.threads)
            elif forked is not None and forked.pid:
                env = template.env
                new = await connect(fresh, forked.pid, self.stamp, env, template=True)
            elif forked is not None:
                log.warning("warm template forked no successor", error=forked.error)
            if new is not None:
                self.current = new
            return forked is not None
        finally:
            if self._succession is not None and not self._succession.done():
                self._succession.set_result(new)

    async def stop(self) -> None:
        """No more templates: kill the current one (its forks and ranks live on)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        template, self.current = self.current, None
        if template is not None:
            await kill(template)

    async def fork(self, *, ready: bool = False) -> Spare | None:
        """A spare forked from the ready template, after the imports of the script
        :attr:`preload` names; None without one. ``ready``: once it has said READY (for a
        launch that found no spare ready: milliseconds), else with its READY to come."""
        spare = await self._fork()
        if spare is None or not ready:
            return spare
        with contextlib.suppress(TimeoutError):
            if await asyncio.wait_for(settle(spare), HANDOVER_S):
                return spare
        await kill(spare)
        return None

    async def _fork(self) -> Spare | None:
        async with self._asking:
            template = self.ready()
            if template is None:
                return None
            if (script := self.preload()) != self.preloaded:
                said = await self._ask(template, Preload(script=script), PRELOAD_S, Preloaded)
                if said is None:
                    return None
                self.preloaded = script
                log.info(
                    "warm template imported a script's libraries",
                    script=script,
                    imports_s=said.imports_s,
                )
            fresh = self.directory / f"new-{uuid.uuid4().hex[:12]}.sock"
            fork = Fork(socket=str(fresh), netns=netns() if template.shared else "")
            # a shared template answers the other agents' requests too (a preload: seconds)
            bound = PRELOAD_S if template.shared else HANDOVER_S
            forked = await self._ask(template, fork, bound, Forked)
            if forked is None:
                return None
            if forked.threads:
                await self._no_forks(template, forked.threads)
                return None
            if not forked.pid:
                fresh.unlink(missing_ok=True)
                log.warning("warm template forked no spare", error=forked.error)
                return None
            return await connect(fresh, forked.pid, self.stamp, template.env)

    async def _ask(
        self, template: Spare, request: Fork | Preload, bound: float, answer: type[T]
    ) -> T | None:
        """The template's answer; None when it has none (it is killed, wedged or gone; a
        shared one only disconnected from)."""
        try:
            template.writer.write(msgspec.json.encode(request) + b"\n")
            await template.writer.drain()
            line = await asyncio.wait_for(template.reader.readline(), bound)
            return msgspec.json.decode(line, type=answer)
        except (OSError, TimeoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            event = "warm template did not answer: " + ("left" if template.shared else "killed")
            log.warning(event, pid=template.pid, error=repr(exc))
            await kill(template)  # the keeper starts (or joins) the next
            return None

    async def _no_forks(self, template: Spare, threads: int) -> None:
        log.warning(
            "warm template has threads: spares are started with exec from now on",
            pid=template.pid,
            threads=threads,
            log=str(self.log_path),
        )
        self.forks = False
        await self.stop()

    async def _keep(self) -> None:
        while self.forks and self.wanted():
            try:
                await retrying_async(
                    (TemplateDied,),
                    first_s=RESTART_FIRST_S,
                    cap_s=RESTART_CAP_S,
                    give_up=lambda: not (self.forks and self.wanted()),
                    note=self._died,
                )(self._one)
            except TemplateDied:
                return  # no longer wanted

    def _died(self, error: BaseException, wait_s: float) -> None:
        log.warning(
            "warm template died: the next starts after a backoff",
            error=str(error),
            wait_s=round(wait_s, 1),
            log=str(self.log_path),
        )

    async def _one(self) -> None:
        """One template's life: started (or the adopted one), ready, gone. TemplateDied
        if it died before it served :data:`STEADY_S`."""
        template = self.current
        if template is None:
            self.stamp = code_stamp(self.command)
            template = await self._join() if self.shared is not None else None
            if template is None:
                self.preloaded = self.preload()
                env = dict(self.env())
                template = await start(
                    self.command, self.directory, self.stamp, env, self.log_path, template=True
                )
            if template is None:
                raise TemplateDied("it could not be started")
            self.current = template
        ready_at = None
        if template.ready or await settle(template):  # (a successor says READY anew)
            ready_at = time.monotonic()
            import_s = None  # an adopted one began importing before this agent
            if template.child is not None:
                import_s = ready_at - template.born
                log.info("warm template ready", pid=template.pid, import_s=round(import_s, 2))
            self.on_ready(import_s)

        async def gone() -> bool:
            return template is not self.current or not template.alive()

        await wait_until_async(gone, None, POLL_S)
        if template is not self.current:  # handed a launch: a rank now
            if self._succession is None or await self._succession is None:
                await asyncio.sleep(self.refill_delay_s)  # no successor: start the next
            return
        self.current = None
        code = await kill(template)
        if ready_at is not None and time.monotonic() - ready_at >= STEADY_S:
            log.warning("warm template died: the next starts now", code=code)
            return
        raise TemplateDied(f"it ended with {code} {'after' if ready_at else 'before'} it was ready")

    async def _join(self) -> Spare | None:
        """The shared template, ready (None: nothing answers there, said once: this pool
        starts its own). Its forks are named with this agent's stamp: an agent shares
        only a template of its own install (the local cluster's)."""
        assert self.shared is not None
        joined = await join(self.shared, FIRST_IMPORT_WAIT_S)
        if isinstance(joined, str):
            if not self.fell_back:
                log.warning(
                    "shared warm template does not answer: this agent starts its own",
                    socket=str(self.shared),
                    error=joined,
                )
            self.fell_back = True
            return None
        log.info("warm template shared", pid=joined.pid, socket=str(self.shared))
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # where forks listen
        self.preloaded = ""  # none of this node's scripts, as far as this agent knows
        return joined
