"""Hang judgment, pure: from a rank's beat, its process state and its stacks, is it hung,
and is it the culprit or a victim?

A rank that stops making progress without exiting holds every peer in the next
collective; the process group's own timeout is half an hour. Each rank's beat thread
(``ringmaster.rank.beat``) says which step it completed when and in which phase it is; the node
agent's watch (``nodeagent.hangwatch_loop``) reads it with ``/proc/<pid>/stat`` and asks
this module for a verdict, capturing the rank's Python stacks when the verdict needs them.

The rules, in order:

- Start-up (a first step may compile for minutes), checkpoints, pauses and the end make
  no steps by design: a running rank in those phases is never hung, nor is one before its
  first step. Stalled time counts from the later of the last step and the phase's start.
- A stretch the loop named (``loop`` phase: evaluation, data loading, its own saving,
  through ``ringmaster.rank.phase``) is judged from its start by its own bound, the job's
  threshold when it gave none.
- The threshold is ``max(hang_step_factor × median step time, hang_floor_s)``.
- A process stopped (state ``T``/``t``) makes no progress whatever its phase: stopped for
  the threshold (and at least :data:`STOPPED_MIN_S`), it is the culprit.
- A rank stalled past the threshold whose beat is silent (:data:`BEAT_SILENT_S`) while
  its process runs is wedged (its beat thread cannot get the GIL): the culprit.
- Otherwise its stacks decide: a main thread inside a collective (torch.distributed,
  autograd's backward, DeepSpeed's comm), or a beat saying the rank is in the step's
  collective (with NCCL the main thread blocks in the sync after it, in the trainer's own
  code), waits for a peer — a victim, not reported; one stalled anywhere else is the
  culprit.
- When none of a node's stalled ranks can be singled out and they stay stalled for twice
  their threshold, the lowest is reported as "culprit unknown" (:func:`fallback`), so a
  stall whose culprit sits on another node, or is invisible, is still reported.

What cannot be seen: ranks without a beat (a user's ``entry`` script that does not open
the rank API) can only be judged stopped; a rank spinning inside a collective that never
completes, or whose GPU hangs under the step's collective, looks like a victim (the
fallback reports it).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

from nodeagent.rankprobe import STOPPED
from proto.job import PolicySection
from ringmaster.rankbeat import DONE, LOOP, TRAINING, RankBeat

BEAT_SILENT_S = 2.0  # four missed beats: the beat thread is not running
STOPPED_MIN_S = 2.0  # a debugger's or profiler's brief stop is not a hang
FALLBACK_FACTOR = 2.0
UNKNOWN = "culprit unknown: every stalled rank on this node waits in a collective"

# Frames that mean "inside a collective": the main thread waits for its peers there.
_COLLECTIVE = re.compile(
    r"/torch/distributed/|/torch/autograd/|/torch/nn/parallel/distributed\.py$"
    r"|/deepspeed/comm/|/deepspeed/runtime/comm/"
)
_HEADER = re.compile(r"^(Current thread|Thread) 0x([0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')


class Kind(enum.StrEnum):
    OK = "ok"
    STALLED = "stalled"  # past the threshold; its stacks must decide
    VICTIM = "victim"  # stalled, but cannot be singled out (waits in a collective)
    CULPRIT = "culprit"


@dataclass(frozen=True)
class Proc:
    """What the watch saw of the rank's process."""

    pid: int
    state: str  # the state letter of /proc/<pid>/stat ("" when unreadable)
    stopped_s: float = 0.0  # how long the watch has seen it stopped without a break

    @property
    def stopped(self) -> bool:
        return self.state in STOPPED


@dataclass(frozen=True)
class Thresholds:
    step_factor: float = PolicySection().hang_step_factor
    floor_s: float = PolicySection().hang_floor_s

    @classmethod
    def of(cls, policy: PolicySection) -> Thresholds:
        return cls(policy.hang_step_factor, policy.hang_floor_s)

    def limit(self, beat: RankBeat | None) -> float:
        median = beat.step_s if beat is not None else 0.0
        return max(self.step_factor * median, self.floor_s)


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    stalled_s: float = 0.0
    threshold_s: float = 0.0
    evidence: str = ""


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.func} ({self.file}:{self.line})"


OK = Verdict(Kind.OK)


def judge(
    beat: RankBeat | None,
    proc: Proc,
    now: float,
    thresholds: Thresholds,
    stacks: str | None = None,
) -> Verdict:
    """The verdict on one rank at ``now`` (the beat's clock, ``CLOCK_MONOTONIC``).
    ``stacks`` is its faulthandler dump when captured; STALLED asks for it."""
    if beat is not None and beat.phase == DONE:
        return OK
    limit = thresholds.limit(beat)
    training = beat is not None and beat.phase == TRAINING and beat.step_at is not None
    stalled = 0.0
    if beat is not None and beat.step_at is not None and training:
        stalled = now - max(beat.step_at, beat.phase_since)
    elif beat is not None and beat.phase == LOOP:
        # a stretch the loop named: judged by its own bound, from when it began
        training, stalled = True, now - beat.phase_since
        limit = beat.bound_s if beat.bound_s is not None else limit
    if proc.stopped:
        stalled = max(stalled, proc.stopped_s)
        if proc.stopped_s >= min(limit, STOPPED_MIN_S) and stalled >= limit:
            evidence = f"process stopped (state {proc.state}) for {proc.stopped_s:.1f} s"
            return Verdict(Kind.CULPRIT, stalled, limit, evidence)
        return OK
    if beat is None or not training or stalled < limit:
        return OK
    silent = now - beat.updated
    if silent > BEAT_SILENT_S:
        evidence = (
            f"beat silent for {silent:.1f} s while the process runs (state {proc.state}): "
            "wedged holding the GIL"
        )
        return Verdict(Kind.CULPRIT, stalled, limit, evidence)
    if stacks is None:
        return Verdict(Kind.STALLED, stalled, limit)
    if beat.in_collective:
        return Verdict(
            Kind.VICTIM, stalled, limit, "waits in the step's collective (its beat says)"
        )
    frames = main_frames(stacks, beat.main_thread)
    if not frames:
        return Verdict(Kind.VICTIM, stalled, limit, "no stacks: cannot tell where it waits")
    inside = collective_frame(frames)
    if inside is not None:
        return Verdict(Kind.VICTIM, stalled, limit, f"waits in a collective: {inside}")
    evidence = f"stalled outside any collective: main thread in {frames[0]}"
    return Verdict(Kind.CULPRIT, stalled, limit, evidence)


def fallback(verdicts: Mapping[int, Verdict]) -> int | None:
    """The rank to report for one job on this node when no culprit stands out: the lowest
    stalled rank, once every stalled rank has been stalled for twice its threshold."""
    if any(v.kind == Kind.CULPRIT for v in verdicts.values()):
        return None
    stalled = {r: v for r, v in verdicts.items() if v.kind in (Kind.STALLED, Kind.VICTIM)}
    if stalled and all(v.stalled_s >= FALLBACK_FACTOR * v.threshold_s for v in stalled.values()):
        return min(stalled)
    return None


def threads(dump: str) -> dict[int, list[Frame]]:
    """Each thread's frames (innermost first) in a faulthandler dump, by thread id; the
    main thread is listed last by the interpreter, so it is the last key when present."""
    found: dict[int, list[Frame]] = {}
    frames: list[Frame] | None = None
    for line in dump.splitlines():
        if header := _HEADER.match(line):
            frames = found.setdefault(int(header[2], 16), [])
            frames.clear()  # a later dump of the same thread wins
        elif frames is not None and (frame := _FRAME.match(line)):
            frames.append(Frame(frame["file"], int(frame["line"]), frame["func"]))
    return found


def main_frames(dump: str, main_thread: int) -> list[Frame]:
    """The main thread's frames: by its id (the beat carries it), else the last thread."""
    found = threads(dump)
    if main_thread in found:
        return found[main_thread]
    return found[list(found)[-1]] if found else []


def collective_frame(frames: list[Frame]) -> Frame | None:
    """The innermost frame that belongs to a collective, if any."""
    for frame in frames:
        if _COLLECTIVE.search(frame.file) or (
            frame.file.endswith("/torch/_tensor.py") and frame.func == "backward"
        ):
            return frame
    return None


def threads_in(dump: str) -> set[int]:
    """The thread ids whose blocks a faulthandler dump holds."""
    return {int(m[2], 16) for line in dump.splitlines() if (m := _HEADER.match(line))}


def main_first(dump: str, main_thread: int, cap: int) -> str:
    """The dump from its first thread header, the main thread's block first, at most
    ``cap`` characters: what an event carries."""
    lines = dump.splitlines()
    starts = [i for i, line in enumerate(lines) if _HEADER.match(line)]
    if not starts:
        return ""
    blocks = [
        "\n".join(lines[a:b]).strip()
        for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)
    ]
    ids = [int(_HEADER.match(lines[i])[2], 16) for i in starts]  # type: ignore[index]
    main = ids.index(main_thread) if main_thread in ids else len(blocks) - 1
    text = "\n\n".join([blocks[main], *blocks[:main], *blocks[main + 1 :]])
    return text if len(text) <= cap else text[: cap - 14] + "\n… (truncated)"
