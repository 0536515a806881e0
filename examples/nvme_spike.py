"""The walking-skeleton scenario, end to end, through the operator's CLI only:

up (2 simulated nodes) → start examples/tiny.toml → inject an NVMe latency spike on
node-1 mid-run → the job pauses → clear → the job resumes → it completes → down, with no
process left. Exits 0 when every check holds, 1 otherwise; prints what it checks.

    python examples/nvme_spike.py [--home DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from coordinator.ctl.home import pids_dir
from ringmaster.procs import pid_alive, read_pid, wait_until

HERE = Path(__file__).resolve().parent
CTL = [sys.executable, "-m", "coordinator.ctl.main"]
EXPECTED = [
    "job.started",
    "nvme.latency_spike",
    "job.paused",
    "nvme.latency_recovered",
    "job.resumed",
    "job.completed",
]


def ctl(*args: str, check: bool = True) -> str:
    done = subprocess.run([*CTL, *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise SystemExit(
            f"coordinatorctl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def say(text: str) -> None:
    print(f"==> {text}", flush=True)


def job_status(job: str) -> dict:
    return json.loads(ctl("status", job, "--json"))


def wait_for(job: str, what: str, pred: Callable[[dict], bool], timeout: float = 120.0) -> dict:
    def reached() -> dict | None:
        status = job_status(job)
        if pred(status):
            return status
        if status["state"] in ("failed", "stopped"):
            raise SystemExit(f"job ended {status['state']}: {status.get('reason')}")
        return None

    try:
        return wait_until(reached, timeout, interval=0.2)
    except TimeoutError:
        raise SystemExit(f"timed out waiting for {what}") from None


def events(job: str) -> list[dict]:
    out = ctl("tail", "--no-follow", "--json")
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [e for e in rows if e.get("job") in (job, None)]


def stamp(event: dict) -> float:
    return datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--home", default=os.environ.get("RINGMASTER_HOME", ".ringmaster/demo"))
    p.add_argument("--keep", action="store_true", help="leave the cluster running")
    p.add_argument("--steps", type=int, default=200, help="steps to train (at least 60)")
    args = p.parse_args()
    if args.steps < 60:
        p.error("--steps must be at least 60: the spike comes at step 40")
    home = Path(args.home).resolve()
    os.environ["RINGMASTER_HOME"] = str(home)
    ctl("down", check=False)
    shutil.rmtree(home, ignore_errors=True)

    say(f"bringing up a 2-node local cluster in {home}")
    ctl("up", "--nodes", "2")
    pids = {f.stem: read_pid(f) for f in pids_dir(home).glob("*.pid")}
    try:
        say("submitting examples/tiny.toml")
        submitted = time.time()
        job = ctl(
            "start",
            str(HERE / "tiny.toml"),
            "--set",
            f"checkpoint.dir={home / 'checkpoints' / 'tiny-gpt'}",
            "--set",
            f"train.steps={args.steps}",
        ).strip()
        print(f"    job id {job}")
        first = wait_for(job, "the first step", lambda s: s["step"] >= 1)
        say(
            f"training: step {first['step']}, time from start to first step "
            f"{first['first_step_at'] - submitted:.2f} s"
        )
        wait_for(job, "step 40", lambda s: s["step"] >= 40)
        say("injecting a 500 µs NVMe latency spike on node-1")
        injected = time.time()
        ctl("inject", "node-1", "nvme-latency=500")
        paused = wait_for(job, "the pause", lambda s: s["state"] == "paused", timeout=30)
        say(f"job paused at step {paused['step']}")
        time.sleep(2.0)
        say("clearing the fault")
        ctl("inject", "node-1", "clear")
        wait_for(job, "the resume", lambda s: s["state"] == "running", timeout=30)
        say("job resumed; waiting for completion")
        final = wait_for(job, "completion", lambda s: s["state"] == "completed", timeout=180)
        history = events(job)
        kinds = [e["kind"] for e in history]
        say("event history:")
        print(ctl("tail", "--no-follow"), end="")
        say(f"status {job}:")
        print(ctl("status", job), end="")
        failures = check(final, kinds)
        spike = next(e for e in history if e["kind"] == "nvme.latency_spike")
        pause = next(e for e in history if e["kind"] == "job.paused")
        timings = {
            "start_to_first_step_s": round(final["first_step_at"] - submitted, 3),
            "inject_to_spike_event_s": round(stamp(spike) - injected, 3),
            "inject_to_paused_s": round(stamp(pause) - injected, 3),
            "spike_event_to_paused_s": round(stamp(pause) - stamp(spike), 3),
        }
        say(f"timings {json.dumps(timings)}")
        page = home / "report.html"
        say(f"report {job} at 2.5 a GPU-hour (timeline in {page})")
        print(ctl("report", job, "--price-per-gpu-hour", "2.5", "--html", str(page)), end="")
    finally:
        if not args.keep:
            say("bringing the cluster down")
            ctl("down", check=False)
    if not args.keep:
        alive = [f"{name} ({pid})" for name, pid in pids.items() if pid and pid_alive(pid)]
        if alive:
            failures.append(f"still running after down: {', '.join(alive)}")
    for failure in failures:
        print(f"FAIL: {failure}")
    say("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


def check(final: dict, kinds: list[str]) -> list[str]:
    failures = []
    if final["state"] != "completed":
        failures.append(f"state {final['state']}, expected completed")
    if final["step"] != final["target_steps"]:
        failures.append(f"step {final['step']} != target_steps {final['target_steps']}")
    if final["pauses"] < 1:
        failures.append("pauses == 0, expected at least one")
    if final["restarts"] != 0:
        failures.append(f"restarts {final['restarts']}, expected 0")
    positions = [kinds.index(k) if k in kinds else -1 for k in EXPECTED]
    if -1 in positions or positions != sorted(positions):
        failures.append(f"events out of order or missing: saw {kinds}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
