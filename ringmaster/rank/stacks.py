"""Stacks on demand, taken safely: a daemon thread waits on a FIFO beside the rank's beat
and, for each byte the node agent writes to it, appends every thread's Python stack to
stderr (the rank's log) in ``faulthandler``'s format, which the agent's hang watch reads.

Why not ``faulthandler`` alone: its dump walks the other threads' frames without the GIL,
so a thread that runs meanwhile (the beat, or any thread whose wait ran out while the
rank was stopped and that unwinds once it is continued) can free a frame under it; that
was seen to crash the rank with SIGSEGV. This thread holds the GIL while it formats, so
no frame changes under it. It needs the GIL to be free, which it is while the main thread
waits in a collective or sleeps; a rank wedged in C code holding the GIL answers nothing
here, and the agent then falls back to ``faulthandler`` on
``ringmaster.rundir.STACKS_SIGNAL`` (which the rank registers beside this thread: the rank
API's driver, the built-in trainer's worker), safe in that case since no other thread can
run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from ringmaster import rank_env
from ringmaster.rundir import stacks_beside


def dump(out: TextIO) -> None:
    """Every thread's stack but this one's, innermost frame first, the main thread last
    (as ``faulthandler`` orders them), flushed in one write."""
    me = threading.get_ident()
    main = threading.main_thread().ident
    frames = sys._current_frames()
    order = [t for t in frames if t not in (me, main)] + ([main] if main in frames else [])
    blocks = []
    for ident in order:
        assert ident is not None
        lines = [f"Thread 0x{ident:016x} (most recent call first):"]
        for frame in reversed(traceback.extract_stack(frames[ident])):
            lines.append(f'  File "{frame.filename}", line {frame.lineno} in {frame.name}')
        blocks.append("\n".join(lines))
    out.write("\n\n".join(blocks) + "\n\n")
    out.flush()


def serve(path: Path, out: TextIO | None = None) -> bool:
    """Answer stack requests written to the FIFO ``path`` (made anew) from a daemon
    thread; False, with nothing started, when the FIFO cannot be made."""
    try:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.mkfifo(path, 0o600)
        # read-write: the open neither blocks for a writer nor sees EOF when one leaves
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        print(f"trainer: no stacks on request ({path}: {exc})", file=sys.stderr)
        return False
    threading.Thread(target=_answer, args=(fd, out), name="rank-stacks", daemon=True).start()
    return True


def serve_from_env(env: Mapping[str, str], rank: int) -> bool:
    """:func:`serve` on the FIFO beside the job spec the agent wrote; False without one."""
    spec = env.get(rank_env.JOB_SPEC)
    return serve(stacks_beside(Path(spec), rank)) if spec else False


def _answer(fd: int, out: TextIO | None) -> None:
    while os.read(fd, 64):
        with contextlib.suppress(Exception):  # a closed stderr must not end training
            dump(out if out is not None else sys.stderr)
