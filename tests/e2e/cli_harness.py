"""The operator's view for end-to-end tests: coordinatorctl run as a real subprocess
against a local cluster directory, with the waits every scenario needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
Status = dict[str, Any]


def alive(pid: int) -> bool:
    """Running, not a zombie (a reaped-late child is not a running process)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


class Ctl:
    def __init__(self, home: Path, **env: str) -> None:
        self.home = home
        self.env = {**os.environ, "RINGMASTER_HOME": str(home), **env}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "coordinator.ctl.main", *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=300,
            check=False,
        )

    def __call__(self, *args: str) -> str:
        done = self.run(*args)
        assert done.returncode == 0, f"coordinatorctl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def status(self, job: str | None = None, retries: int = 20) -> Status:
        """``status --json``; a transient bus error (a server failing over) is retried,
        and must itself be one line."""
        for _ in range(retries):
            done = self.run("status", *([job] if job else []), "--json")
            if done.returncode == 0:
                result: Status = json.loads(done.stdout)
                return result
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
            time.sleep(0.5)
        raise AssertionError(done.stderr)

    def wait(self, job: str, pred: Callable[[Status], bool], timeout: float = 200) -> Status:
        deadline = time.monotonic() + timeout
        while not pred(status := self.status(job)):
            if not pred(status) and status["state"] in ("failed", "stopped", "completed"):
                raise AssertionError(f"job ended {status['state']}: {status.get('reason')}")
            assert time.monotonic() < deadline, f"timed out; last status {status}"
            time.sleep(0.2)
        return status

    def events(self, *filters: str) -> list[Status]:
        out = self("tail", "--no-follow", "--json", *filters)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def start(self, job_file: str = "tiny.toml", *overrides: str) -> str:
        sets = [arg for item in overrides for arg in ("--set", item)]
        return self("start", str(EXAMPLES / job_file), *sets).strip()
