"""Short structured log lines on stderr, one per event:
``trainer t=3.21 wall=1796070000.123 rank=0 attempt=2 event=step step=5``.

logfmt (written by :func:`ringmaster.logfmt.render`, read back by
:func:`ringmaster.logfmt.parse_line`) so both people and tests can read them, a value with
spaces quoted whole; the node agent captures each rank's stderr into its log file. ``t``
is seconds since the process started, ``wall`` the Unix time: lines of ranks on different
nodes and attempts line up on it (the recovery benchmark and the ledger check read it).
``attempt`` is the job attempt the agent launched this rank for (``RINGMASTER_ATTEMPT``, 0
outside an agent), so a line says which attempt wrote it although attempts share a log.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

from ringmaster.logfmt import lines, render


class Log:
    def __init__(self, rank: int, attempt: int = 0) -> None:
        self.rank = rank
        self.attempt = attempt
        self.start = time.monotonic()

    def __call__(self, event: str, **fields: object) -> None:
        head = {
            "trainer": True,  # a bare word: whose line this is
            "t": f"{time.monotonic() - self.start:.2f}",
            "wall": f"{time.time():.3f}",
            "rank": self.rank,
            "attempt": self.attempt,
            "event": event,
        }
        line = render({**head, **{k: _fmt(v) for k, v in fields.items()}})
        print(line, file=sys.stderr, flush=True)


def _fmt(value: object) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def read(text: str) -> Iterator[dict[str, str]]:
    """The lines :class:`Log` wrote in a rank's log (whatever else the rank printed there
    is skipped), each as its fields: ``wall``, ``rank``, ``event`` and the event's own.
    A line may follow what a progress bar left on the same line (it redraws itself after
    a carriage return, with no newline): it is read from its own start."""
    return (r for r in lines("\n".join(map(_own, text.split("\n")))) if r.keys() >= _HEAD)


def _own(line: str) -> str:
    start = line.find(_START)
    return line[start:] if start > 0 else line


_HEAD = frozenset(("trainer", "wall", "rank", "event"))
_START = "trainer t="  # how every line :class:`Log` writes begins
