"""The rank's beat (:mod:`ringmaster.rankbeat`): a daemon thread rewrites it every half
second with the current step and phase, so the node agent can tell a rank that makes no
progress from one that is merely slow.

Why a thread: torch releases the GIL while the main thread waits in a gloo or NCCL
collective, so the beat goes on while the rank waits for a peer. A beat that falls silent
while the process exists therefore means the process itself is stopped or wedged (holding
the GIL in C code), while a beat that goes on without new steps means the rank waits (in a
collective, as a victim of a peer, or in its own code, as the culprit) — which the agent
tells apart from the rank's stacks (:mod:`ringmaster.rank.stacks`).

The training loop reports completed steps (with their time) and phase changes; phases
that legitimately make no step progress — start-up, checkpoints, pauses, the end — are
named so that they are never judged as hangs. Every time the beat carries is read from the
clock it is given: a rank's is the system's, since the agent compares the beat's times
with its own ``CLOCK_MONOTONIC``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path

from msgspec.structs import replace

from ringmaster import rank_env, rankbeat
from ringmaster.clock import SYSTEM, Clock
from ringmaster.rankbeat import DONE, LOOP, STARTUP, TRAINING, Phase, RankBeat
from ringmaster.rundir import beat_beside

WINDOW = 20  # steps the median step time is taken over


class Beat:
    """Writes ``path`` every ``interval_s`` from a daemon thread; ``path=None`` (a rank
    started without an agent) keeps the state but writes nothing."""

    def __init__(
        self,
        path: Path | None,
        *,
        interval_s: float = rankbeat.WRITE_EVERY_S,
        clock: Clock = SYSTEM,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._times: deque[float] = deque(maxlen=WINDOW)
        now = clock.monotonic()
        self._beat = RankBeat(
            pid=os.getpid(),
            phase=STARTUP,
            phase_since=now,
            main_thread=threading.main_thread().ident or 0,
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int) -> Beat:
        """The beat beside the job spec the agent wrote (``$RINGMASTER_JOB_SPEC``)."""
        spec = env.get(rank_env.JOB_SPEC)
        return cls(beat_beside(Path(spec), rank) if spec else None)

    @property
    def current(self) -> RankBeat:
        with self._lock:
            return self._beat

    def step_done(self, step: int, seconds: float) -> None:
        """Step ``step`` completed in ``seconds``; the first one ends start-up."""
        now = self.clock.monotonic()
        with self._lock:
            self._times.append(seconds)
            changes: dict[str, object] = {}
            if self._beat.phase == STARTUP:
                changes = {"phase": TRAINING, "phase_since": now}
            self._beat = replace(
                self._beat,
                step=step,
                step_s=statistics.median(self._times),
                step_at=now,
                **changes,
            )

    def set_phase(self, phase: Phase) -> Phase:
        """Enter ``phase``; returns the phase left. Written at once, not at the next tick."""
        with self._lock:
            left = self._beat.phase
            if phase != left:
                self._beat = replace(self._beat, phase=phase, phase_since=self.clock.monotonic())
        if phase != left:
            self._wake.set()
        return left

    @contextlib.contextmanager
    def during(self, phase: Phase) -> Iterator[None]:
        """``phase`` for the duration of the block, then back to the phase before it."""
        left = self.set_phase(phase)
        try:
            yield
        finally:
            self.set_phase(left)

    @contextlib.contextmanager
    def named(self, name: str, bound_s: float | None) -> Iterator[None]:
        """A stretch the loop named (evaluation, data loading …), judged by ``bound_s``
        (None: the job's hang threshold), then back to the phase before it."""
        with self._lock:
            left, before = self._beat.phase, self._beat
            self._beat = replace(
                self._beat,
                phase=LOOP,
                phase_since=self.clock.monotonic(),
                name=name,
                bound_s=bound_s,
            )
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._beat = replace(
                    self._beat,
                    phase=left,
                    phase_since=self.clock.monotonic(),
                    name=before.name,
                    bound_s=before.bound_s,
                )
            self._wake.set()

    @contextlib.contextmanager
    def in_collective(self) -> Iterator[None]:
        """The block waits for the other ranks (a collective and the sync after it)."""
        with self._lock:
            self._beat = replace(self._beat, in_collective=True)
        try:
            yield
        finally:
            with self._lock:
                self._beat = replace(self._beat, in_collective=False)

    def start(self) -> Beat:
        if self.path is not None and self._thread is None:
            self._write()
            self._thread = threading.Thread(target=self._run, name="rank-beat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Phase ``done``, written, and the thread ended."""
        self.set_phase(DONE)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        if self.path is not None:
            self._write()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self._write()

    def _write(self) -> None:
        assert self.path is not None
        with self._lock:
            beat = replace(self._beat, updated=self.clock.monotonic(), wall=self.clock.time())
        try:
            rankbeat.write(self.path, beat)
        except OSError as exc:  # a full or vanished disk must not end training
            if not self._warned:
                self._warned = True
                print(f"trainer: cannot write the beat {self.path}: {exc}", file=sys.stderr)
