"""The rehearsal knobs of a simulated node, as one rank reads them.

``coordinatorctl inject NODE slow=F|nan-loss`` writes the node's knobs file
(:class:`proto.faults.SimKnobs`, JSON); the agent of a simulated node names it in
``$RINGMASTER_SIM_KNOBS`` and sets ``RINGMASTER_SIMULATED=1``. A rank on a real node never
has both, so nothing here can slow down or poison real training.

The file is polled once per step, so polling must cost next to nothing: one ``stat``, and a
read only when its modification time, size or inode changed. A missing or malformed file
means the defaults (no fault), with one warning line in the rank log per such change,
never a crash: a rehearsal knob must not be able to kill the job it rehearses on.

``nan_loss`` is a counter, not a flag, so that two injections are two faults and a
restarted rank does not fire again for old ones: the value seen when the rank started is
the baseline, and every increase after that asks for one poisoned step. A counter that
goes down (``clear`` resets the knobs) becomes the new baseline. Only the node's first rank
(``LOCAL_RANK`` 0) poisons its loss: one poisoned rank is enough to make the all-reduced
loss non-finite everywhere, and ranks that each noticed the file at a different step would
turn one injection into several faults. ``slow`` applies to every rank of the node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec

from proto.faults import SimKnobs
from ringmaster import rank_env

Warn = Callable[[str], None]


class SimKnobsReader:
    def __init__(self, path: Path, warn: Warn, *, poisons: bool = True) -> None:
        self.path = path
        self.warn = warn
        self.poisons = poisons  # whether this rank acts on nan_loss (the node's first)
        self._key: tuple[int, int, int] | None = None  # (mtime_ns, size, inode) last read
        self._problem = ""  # the last warning given, so a broken file warns once
        self.knobs = SimKnobs()
        self._seen_nan = 0
        self.pending_nan = 0
        self._started = False
        self.poll()  # requests made before this rank started are the baseline
        self._started = True

    @classmethod
    def from_env(cls, env: Mapping[str, str], warn: Warn) -> SimKnobsReader | None:
        """The reader for this rank, or None where the knobs do not apply (a real node)."""
        path = env.get(rank_env.SIM_KNOBS)
        if env.get(rank_env.SIMULATED) != "1" or not path:
            return None
        return cls(Path(path), warn, poisons=env.get("LOCAL_RANK", "0") == "0")

    @property
    def slow(self) -> float:
        """How many times its normal compute time a step should take on this rank."""
        return self.knobs.slow

    def poll(self) -> SimKnobs:
        """The current knobs, re-reading the file only when it changed."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            # never written, or cleared (``clear`` deletes it): no fault, counting restarts
            self._key = None
            self._problem = ""
            self._set(SimKnobs())
            return self.knobs
        except OSError as exc:
            self._key = None
            return self._fallback(f"{self.path} unreadable ({exc.strerror}); using defaults", 0)
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key == self._key:
            return self.knobs
        self._key = key
        try:
            knobs = msgspec.json.decode(self.path.read_bytes(), type=SimKnobs)
        except (OSError, msgspec.DecodeError) as exc:
            return self._fallback(f"{self.path} malformed ({exc}); using defaults", self._seen_nan)
        if not (knobs.slow >= 1.0 and knobs.nan_loss >= 0):
            why = f"{self.path} out of range ({knobs}); using defaults"
            return self._fallback(why, self._seen_nan)
        self._problem = ""
        self._set(knobs)
        return knobs

    def take_nan(self) -> bool:
        """Whether this step's loss is to be made non-finite (consumes one request)."""
        if self.pending_nan == 0:
            return False
        self.pending_nan -= 1
        return self.poisons

    def _set(self, knobs: SimKnobs) -> None:
        self.knobs = knobs
        if self._started and knobs.nan_loss > self._seen_nan:
            self.pending_nan += knobs.nan_loss - self._seen_nan
        self._seen_nan = knobs.nan_loss

    def _fallback(self, problem: str, nan_loss: int) -> SimKnobs:
        """Normal speed; ``nan_loss`` kept as counted so far, except where the file is gone
        (a broken file must not make old requests look new)."""
        if problem != self._problem:
            self._problem = problem
            self.warn(problem)
        self._set(SimKnobs(nan_loss=nan_loss))
        return self.knobs
