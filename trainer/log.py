"""Short structured log lines on stderr, one per event: ``trainer rank=0 event=step step=5``.

key=value (logfmt) so both people and tests can read them; the node agent captures each
rank's stderr into its log file.
"""

from __future__ import annotations

import sys
import time


class Log:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.start = time.monotonic()

    def __call__(self, event: str, **fields: object) -> None:
        parts = [f"trainer t={time.monotonic() - self.start:.2f} rank={self.rank} event={event}"]
        parts += [f"{k}={_fmt(v)}" for k, v in fields.items()]
        print(" ".join(parts), file=sys.stderr, flush=True)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return f'"{text}"' if " " in text else text
