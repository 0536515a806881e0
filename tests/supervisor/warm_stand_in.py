"""A stand-in for ``python -m trainer.warm`` in the pool's tests: ``trainer.warm.serve``
around a ``main`` that needs no torch, so a template is ready in a fraction of a second.

It counts its starts (each is what the real one's imports would cost), and, told so by its
environment: dies at once (``SPARE_DIES``), takes ``SPARE_DELAY`` seconds to "import", or
starts a thread first (``SPARE_THREAD``: it may not fork). Its ``main`` logs its rank and
working directory, sleeps ``$SLEEP`` and returns ``$CODE``."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SPARE = textwrap.dedent(
    """
    import os, sys, threading, time
    sys.path.insert(0, {repo!r})
    with open({counter!r}, "a") as f:
        f.write("x")
    if os.environ.get("SPARE_DIES"):
        sys.exit(3)
    time.sleep(float(os.environ.get("SPARE_DELAY", "0")))
    if os.environ.get("SPARE_THREAD"):
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    from trainer.warm import serve

    def main(argv):
        print("rank", os.environ.get("RANK"), "in", os.getcwd(), flush=True)
        time.sleep(float(os.environ.get("SLEEP", "0")))
        return int(os.environ.get("CODE", "0"))

    serve(main)
    """
)


def stand_in(tmp_path: Path) -> list[str]:
    """The command that starts one."""
    script = tmp_path / "spare.py"
    script.write_text(SPARE.format(repo=str(REPO), counter=str(tmp_path / "starts")))
    return [sys.executable, str(script)]


def starts(tmp_path: Path) -> int:
    """How many have started (imported) in ``tmp_path``'s test."""
    path = tmp_path / "starts"
    return len(path.read_text()) if path.exists() else 0
