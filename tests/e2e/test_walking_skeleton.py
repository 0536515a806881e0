"""The README's scenario, as a user runs it: a local 2-node cluster trains, is disturbed
by an NVMe latency spike, pauses, resumes, completes, and ``down`` leaves nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nvme_spike_pauses_and_resumes_the_job_to_completion(tmp_path: Path) -> None:
    home = tmp_path / "cluster"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "nvme_spike.py"), "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "==> all checks passed" in done.stdout
    figures = json.loads(
        next(line for line in done.stdout.splitlines() if line.startswith("==> timings "))[12:]
    )
    assert 0 < figures["spike_event_to_paused_s"] < figures["inject_to_paused_s"]
    assert not list(home.glob("pids/*.pid")), "down must remove every PID file"
