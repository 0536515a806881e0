"""A rank's beat: the small file a training rank rewrites every half second and its node
agent reads to tell a hung rank from a slow one (``nodeagent.hangwatch``).

Why a file and not the control socket: only rank 0 talks to the agent, and a hung rank
must be found whichever rank it is. The file lives beside the rank's PID and log files
(``JobDir.rank_beat``); the rank finds its job directory as the parent of
``$RINGMASTER_JOB_SPEC``.

Why the times are ``time.monotonic()`` (Linux's ``CLOCK_MONOTONIC``, one clock for every
process on the host) rather than wall time: the agent itself steps the wall clock when it
resyncs a drifting node, and a step must not make a healthy rank look stalled. ``wall`` is
the wall time of the write, for people reading the file.

Writes are atomic (a temporary file renamed over the old one), so a reader sees a whole
beat or the previous one; a missing, partial or foreign file reads as no beat.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Literal

import msgspec

WRITE_EVERY_S = 0.5  # how often a rank rewrites its beat (at most this stale when read)
Phase = Literal["startup", "training", "checkpoint", "paused", "done", "loop"]
STARTUP: Phase = "startup"  # until the first step of this process completes
TRAINING: Phase = "training"
CHECKPOINT: Phase = "checkpoint"
PAUSED: Phase = "paused"
DONE: Phase = "done"
# A stretch without steps the loop named itself (evaluation, data loading, its own saving):
# judged by its own bound (``RankBeat.bound_s``), not by the step time.
LOOP: Phase = "loop"


class RankBeat(msgspec.Struct, kw_only=True, frozen=True):
    """One beat. Times are ``CLOCK_MONOTONIC`` seconds, comparable across processes."""

    pid: int
    step: int = 0  # the last step this rank completed
    step_s: float = 0.0  # median seconds per step over the recent steps; 0 before any
    step_at: float | None = None  # when the last step completed; None before the first
    phase: Phase = STARTUP
    phase_since: float = 0.0
    updated: float = 0.0  # when this beat was written
    wall: float = 0.0  # the same moment in wall time (for people)
    main_thread: int = 0  # the main thread's id, as faulthandler prints it in a dump
    # Inside the step's collective, as the rank itself says: where a rank waits for its
    # peers even when its stacks cannot show it (NCCL runs collectives asynchronously, so
    # the main thread blocks in the sync that follows, in the trainer's own code).
    in_collective: bool = False
    # In the LOOP phase: its name, and how long it may last before it counts as stalled
    # (None: the job's hang threshold).
    name: str = ""
    bound_s: float | None = None


_decoder = msgspec.json.Decoder(RankBeat)


def write(path: Path, beat: RankBeat) -> None:
    """Replace ``path`` with ``beat`` atomically (raises ``OSError``)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(msgspec.json.encode(beat))
    tmp.replace(path)


def read(path: Path) -> RankBeat | None:
    """The beat in ``path``; None when it is missing, unreadable or not a beat."""
    with contextlib.suppress(OSError, msgspec.DecodeError):
        return _decoder.decode(path.read_bytes())
    return None
