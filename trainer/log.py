"""Short structured log lines on stderr, one per event:
``trainer t=3.21 wall=1796070000.123 rank=0 event=step step=5``.

key=value (logfmt) so both people and tests can read them; the node agent captures each
rank's stderr into its log file. ``t`` is seconds since the process started, ``wall`` the
Unix time: lines of ranks on different nodes and attempts line up on it (the recovery
benchmark and the ledger check read it).
"""

from __future__ import annotations

import sys
import time


class Log:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.start = time.monotonic()

    def __call__(self, event: str, **fields: object) -> None:
        since = time.monotonic() - self.start
        parts = [f"trainer t={since:.2f} wall={time.time():.3f} rank={self.rank} event={event}"]
        parts += [f"{k}={_fmt(v)}" for k, v in fields.items()]
        print(" ".join(parts), file=sys.stderr, flush=True)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return f'"{text}"' if " " in text else text
