"""What ``bench/soak.py`` watches while it injects: the job record (sampled), the
cluster's event stream (followed), and, at the end, the nodes settling and any process
``down`` left behind."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.cluster_harness import Ctl
from bench.soak_plan import unsettled
from coordinator.ctl.status import node_notes

SAMPLE_S = 3.0  # how often the job record is read
EXCUSED = ("paused", "pending")  # states in which no step is no stall


class Sampler(threading.Thread):
    """Reads the job record every few seconds: the restarts around each fault, and when
    the job was paused or waiting for nodes (those stretches are no stall)."""

    def __init__(self, ctl: Ctl, job: str) -> None:
        super().__init__(daemon=True)
        self.ctl, self.job = ctl, job
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SAMPLE_S):
            with contextlib.suppress(RuntimeError):
                self.samples.append((time.time(), self.ctl.status(self.job, tries=1)))

    def latest(self) -> dict[str, Any]:
        return self.samples[-1][1] if self.samples else {}

    def excused(self) -> list[tuple[float, float]]:
        out = []
        for (t, rec), (later, _) in zip(self.samples, self.samples[1:], strict=False):
            if rec["state"] in EXCUSED or rec.get("waiting_since"):
                out.append((t, later))
        return out


class Events(threading.Thread):
    """The cluster's event stream, followed for the whole soak by one ``tail --json``
    (``--no-follow`` ends after 2 s without a message: too soon on a loaded machine), and
    followed again from the newest event seen whenever it exits (a frozen bus)."""

    def __init__(self, ctl: Ctl) -> None:
        super().__init__(daemon=True)
        self.ctl = ctl
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stopping = False
        self.proc: subprocess.Popen[str] | None = None

    def run(self) -> None:
        newest, lines = time.time(), set()
        while True:
            back = f"{int(time.time() - newest) + 2}s"
            with self.lock:
                if self.stopping:
                    return
                self.proc = subprocess.Popen(
                    self.ctl.argv("tail", "--json", "--since", back),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    env=self.ctl.env,
                    cwd=self.ctl.cwd,
                )
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line in lines or not line.startswith("{"):
                    continue  # replayed after a restart, or not an event
                lines.add(line)
                event = json.loads(line)
                event["at"] = datetime.fromisoformat(event["time"]).timestamp()
                self.events.append(event)
                newest = max(newest, event["at"])
            self.proc.wait()
            time.sleep(1.0)

    def between(self, start: float, end: float) -> list[dict[str, Any]]:
        return sorted((e for e in self.events if start <= e["at"] < end), key=lambda e: e["at"])

    def restart(self) -> None:
        """Follow again from the newest event seen (it loses none: that is replayed)."""
        with self.lock:
            if self.proc is not None:
                self.proc.terminate()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            if self.proc is not None:
                self.proc.terminate()
                self.proc.wait()


def settle(ctl: Ctl, limit_s: float) -> tuple[list[dict[str, Any]], float]:
    """Every node as ``status`` shows it (``why``: its notes), once every live one is
    ready or held for a person, or after ``limit_s``; and the seconds it took."""
    start = time.time()
    while True:
        nodes = [{**n, "why": node_notes(n)} for n in ctl.status()["nodes"]]
        waited = time.time() - start
        if not unsettled(nodes) or waited >= limit_s:
            return nodes, round(waited, 1)
        time.sleep(SAMPLE_S)


def leftovers(home: Path) -> list[str]:
    """Processes still naming the cluster's directory: what ``down`` missed."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if str(home) in argv and int(proc.name) != os.getpid():
                found.append(f"{proc.name} ({argv[:80].strip()})")
    return found
