"""What the cluster benches share: ``coordinatorctl`` run as a subprocess against a local
cluster directory, the ranks' own log lines, and the timing of a fault from them.

The ranks' logs (``DIR/nodes/<node>/agent/jobs/<job>/rank-<r>.log``) are the ground truth a
bench times against: ``wall=`` is each line's Unix time, so the lines of ranks on different
nodes and attempts line up (``ringmaster/rank/log.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ringmaster.procs import wait_until
from ringmaster.rank.log import read

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny.toml"
T = TypeVar("T")


@dataclass
class Record:
    wall: float
    rank: int
    event: str
    fields: dict[str, str]


def read_records(paths: list[Path]) -> list[Record]:
    out = []
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for r in read(text):
            out.append(Record(float(r["wall"]), int(r["rank"]), r["event"], r))
    return sorted(out, key=lambda r: r.wall)


def recovered(records: list[Record], fault_at: float) -> tuple[float, float, int] | None:
    """(wall time of the first step of an attempt started after ``fault_at``, the wall time
    that attempt started, the step it resumed from)."""
    start = next((r for r in records if r.event == "start" and r.wall > fault_at), None)
    if start is None:
        return None
    step = next((r for r in records if r.event == "step" and r.wall > start.wall), None)
    if step is None:
        return None
    return step.wall, start.wall, int(start.fields.get("step", "0"))


def newest_step(records: list[Record], before: float) -> int:
    """The step of the last step line logged by ``before`` (0: none): after a rewind to a
    checkpoint, the step trained to since, not the furthest step ever reached."""
    steps = [int(r.fields["step"]) for r in records if r.event == "step" and r.wall <= before]
    return steps[-1] if steps else 0


def wait_for(predicate: Callable[[], T | None], timeout: float, interval: float) -> T | None:
    """``wait_until``'s result, or None when ``timeout`` passes first."""
    try:
        return wait_until(predicate, timeout, interval)
    except TimeoutError:
        return None


class Ctl:
    """``coordinatorctl`` against the local cluster in ``home``, run from ``cwd`` (where a
    job's relative paths land)."""

    def __init__(self, home: Path, cwd: Path) -> None:
        self.home, self.cwd = home, cwd
        self.env = {**os.environ, "RINGMASTER_HOME": str(home)}

    @staticmethod
    def argv(*args: str) -> list[str]:
        return [sys.executable, "-m", "coordinator.ctl.main", *args]

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.cwd,
            timeout=timeout,
            check=False,
        )

    def __call__(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        """Its stdout; a RuntimeError with its one-line error if it fails (``check``)."""
        done = self.run(*args, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"coordinatorctl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def status(self, *job: str, tries: int = 20) -> dict[str, Any]:
        """``status [JOB] --json``, retried through a transient bus error."""
        for _ in range(tries):
            try:
                found: dict[str, Any] = json.loads(self("status", *job, "--json", timeout=30))
                return found
            except (RuntimeError, subprocess.TimeoutExpired):
                time.sleep(0.5)
        raise RuntimeError("status keeps failing")

    def logs(self, job: str) -> list[Path]:
        return sorted(self.home.glob(f"nodes/*/agent/jobs/{job}/rank-*.log"))
