"""The CPU each rank start of a command costs (an end-to-end scenario, a bench), measured on
this machine while it runs (not a test).

    .venv/bin/python bench/rank_start_cpu.py -- CMD ARGS...

Every process the command starts carries a marker in its environment; the ones running
``trainer.warm`` (templates, spares, ranks started warm) or ``trainer.worker`` (ranks
started cold) are sampled every 0.2 s: utime+stime (``/proc/<pid>/stat``) and where their
stdout goes. A process whose stdout ended in a rank's log is a rank: its log's
``event=started pid=<pid>`` line and its next ``event=step`` give the wall times at which
its CPU is read (between two samples, interpolated). A rank start costs its CPU up to
``started`` and up to its first step (a cold rank imports part of the stack only once its
``main`` runs; a warm one has it all imported), and the templates and spares that never
became ranks cost their whole CPU (the imports forks share), spread over the starts.

It also says what everything the command started cost, daemons included, and its wall
time: this process is their subreaper (``PR_SET_CHILD_SUBREAPER``), so the detached
daemons of a local cluster are reaped here once ``down`` stops them, and the kernel's
count of its children's CPU (``RUSAGE_CHILDREN``) holds all of it, whatever else runs on
the machine.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import re
import resource
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
PR_SET_CHILD_SUBREAPER = 36
ORPHANS_S = 60.0  # how long the command's leftovers may take to end once it has
MARK = "RINGMASTER_RANK_CPU_MARK"
KINDS = (b"trainer.warm", b"trainer.worker")


@dataclass
class Seen:
    command: str
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    stdout: str = ""

    def at(self, wall: float) -> float:
        """The CPU it had used at ``wall``, interpolated between samples."""
        i = bisect.bisect_left(self.times, wall)
        if i == 0:
            return self.cpu[0]
        if i == len(self.times):
            return self.cpu[-1]
        t0, t1, c0, c1 = self.times[i - 1], self.times[i], self.cpu[i - 1], self.cpu[i]
        return c0 + (c1 - c0) * (wall - t0) / (t1 - t0)


def sample(mark: bytes, seen: dict[int, Seen], other: set[tuple[int, str]]) -> None:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            key = (pid, stat[19])
            if key in other:
                continue
            if pid not in seen:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if not any(k in cmdline for k in KINDS) or mark not in Path(
                    f"/proc/{pid}/environ"
                ).read_bytes().split(b"\0"):
                    other.add(key)
                    continue
                seen[pid] = Seen(cmdline.replace(b"\0", b" ").decode(errors="replace"))
            record = seen[pid]
            record.times.append(time.time())
            record.cpu.append((int(stat[11]) + int(stat[12])) / TICK)
            record.stdout = str(Path(f"/proc/{pid}/fd/1").readlink())
        except OSError:
            continue


def walls(log: Path, pid: int) -> tuple[float, float | None] | None:
    """When rank ``pid`` logged ``started``, and its first step after it."""
    text = log.read_text(errors="replace") if log.exists() else ""
    started = re.search(rf"wall=([\d.]+) .*event=started pid={pid}\b", text)
    if started is None:
        return None
    step = re.search(r"wall=([\d.]+) .*event=step ", text[started.end() :])
    return float(started[1]), float(step[1]) if step else None


def reap_orphans() -> int:
    """Reap what the command left running, once it ends (within ``ORPHANS_S``); how many
    are still running after that (not counted)."""
    deadline = time.monotonic() + ORPHANS_S
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid == 0 and time.monotonic() > deadline:
            me = os.getpid()
            return len(Path(f"/proc/{me}/task/{me}/children").read_text().split())
        if pid == 0:
            time.sleep(0.2)


def main() -> None:
    argv = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else sys.argv[1:]
    mark = f"{MARK}={uuid.uuid4().hex}"
    env = {**os.environ, MARK: mark.split("=", 1)[1]}
    seen: dict[int, Seen] = {}
    other: set[tuple[int, str]] = set()
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    begun = time.monotonic()
    proc = subprocess.Popen(argv, env=env)
    while proc.poll() is None:
        sample(mark.encode(), seen, other)
        time.sleep(0.2)
    wall = time.monotonic() - begun
    left = reap_orphans()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"\neverything the command started: {used.ru_utime + used.ru_stime:.1f} CPU-s "
        f"({used.ru_utime:.1f} user, {used.ru_stime:.1f} system) in {wall:.1f} s of wall time"
        + (f"; {left} process(es) still running, not counted" if left else "")
    )
    starts: list[tuple[int, bool, float, float | None]] = []
    idle = 0.0
    for pid, record in seen.items():
        found = walls(Path(record.stdout), pid) if record.stdout.endswith(".log") else None
        if found is None:
            idle += record.cpu[-1]  # a template, or a spare that never ran a rank
            continue
        started, step = found
        warm = "trainer.warm" in record.command
        starts.append((pid, warm, record.at(started), None if step is None else record.at(step)))
    print(f"\ncommand exited {proc.returncode}; rank starts: {len(starts)}")
    for pid, warm, main, step in starts:
        print(
            f"  pid {pid}: {'warm' if warm else 'cold'}, CPU-s to its main {main:.2f}, "
            f"to its first step {'-' if step is None else f'{step:.2f}'}"
        )
    stepped = [step for *_, step in starts if step is not None]
    if stepped:
        total = sum(stepped) + idle
        print(
            f"templates and spares that ran no rank: {idle:.2f} CPU-s\n"
            f"CPU per rank start, to its first step: {total / len(stepped):.2f} s "
            f"({sum(stepped):.2f} + {idle:.2f}) / {len(stepped)}; to its main: "
            f"{(sum(main for _, _, main, _ in starts) + idle) / len(starts):.2f} s"
        )
        setup = [step - main for _, _, main, step in starts if step is not None]
        print(
            f"the rank's own, from started to the first step: median {statistics.median(setup):.2f}"
        )
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
