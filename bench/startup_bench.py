"""Start-to-first-step under Ringmaster versus plain torchrun, and injected NVMe spike to
paused ranks, measured in one run on this machine (not a test).

    .venv/bin/python bench/startup_bench.py [--trials 3] [--spikes 5]

Both start paths run the same job (examples/tiny.toml, world size 2) and are timed the same
way: from the moment the launching command is spawned to the moment rank 0's log first
shows a finished training step (the log is polled every 5 ms). Ringmaster's path is
``coordinatorctl start`` against a local cluster that is already up (``up`` is a one-time
cost); torchrun's is ``torchrun --nproc-per-node 2 -m trainer.worker --config``. Trials
alternate between the two so drift on a noisy machine hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "examples" / "tiny.toml"
CTL = [sys.executable, "-m", "coordinator.ctl.main"]
STEP_MARK = "event=step step=1 "


def ctl(*args: str) -> str:
    return subprocess.run([*CTL, *args], capture_output=True, text=True, check=True).stdout


def wait_for_line(path: Path, mark: str, timeout: float = 120.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and mark in path.read_text(errors="replace"):
            return time.time()
        time.sleep(0.005)
    raise SystemExit(f"no {mark!r} in {path} within {timeout:.0f} s")


def ringmaster_trial(home: Path, n: int) -> float:
    overrides = ["--set", "train.steps=30", "--set", f"checkpoint.dir={home}/ckpt-{n}"]
    t0 = time.time()
    job = subprocess.run(
        [*CTL, "start", str(JOB), *overrides], capture_output=True, text=True, check=True
    ).stdout.strip()
    log = home / "nodes" / "node-0" / "agent" / "jobs" / job / "rank-0.log"
    first = wait_for_line(log, STEP_MARK)
    wait_state(job, {"completed"})
    return first - t0


def torchrun_trial(workdir: Path, n: int) -> float:
    log = workdir / f"torchrun-{n}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RINGMASTER_WORKDIR": str(workdir)}
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(29600 + n),
        "-m",
        "trainer.worker",
        "--config",
        str(JOB),
    ]
    with log.open("wb") as out:
        t0 = time.time()
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir)
        first = wait_for_line(log, STEP_MARK)
        proc.terminate()
        proc.wait(30)
    return first - t0


def wait_state(job: str, states: set[str], timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = json.loads(ctl("status", job, "--json"))
        if status["state"] in states:
            return status
        time.sleep(0.05)
    raise SystemExit(f"{job} did not reach {states}")


def stamp(event: dict) -> float:
    return datetime.fromisoformat(event["time"]).timestamp()


def spike_trials(home: Path, spikes: int) -> list[tuple[float, float]]:
    job = ctl(
        "start",
        str(JOB),
        "--set",
        "train.steps=100000",
        "--set",
        f"checkpoint.dir={home}/ckpt-spikes",
        "--set",
        "checkpoint.every_steps=100000",
    ).strip()
    wait_state(job, {"running"})
    out = []
    for _ in range(spikes):
        ctl("inject", "node-1", "nvme-latency=500")
        t0 = time.time()  # the simulator has applied the fault when inject returns
        wait_state(job, {"paused"})
        ctl("inject", "node-1", "clear")
        wait_state(job, {"running"}, timeout=60)
        events = [
            json.loads(x)
            for x in ctl("tail", "--no-follow", "--since", "60s", "--json").splitlines()
        ]
        spike = max(stamp(e) for e in events if e["kind"] == "nvme.latency_spike")
        paused = max(stamp(e) for e in events if e["kind"] == "job.paused")
        out.append((paused - t0, paused - spike))
    ctl("stop", job)
    wait_state(job, {"stopped", "completed", "failed"})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--spikes", type=int, default=5)
    args = p.parse_args()
    home = Path(tempfile.mkdtemp(prefix="rm-bench-"))
    os.environ["RINGMASTER_HOME"] = str(home)
    ctl("up", "--nodes", "2")
    rm, tr = [], []
    try:
        for n in range(args.trials):
            rm.append(ringmaster_trial(home, n))
            tr.append(torchrun_trial(home, n))
            print(f"trial {n}: ringmaster {rm[-1]:.2f} s, torchrun {tr[-1]:.2f} s", flush=True)
        spikes = spike_trials(home, args.spikes)
    except BaseException:
        print(f"kept {home} for inspection", file=sys.stderr)
        ctl("down")
        raise
    ctl("down")
    shutil.rmtree(home, ignore_errors=True)
    rm_med, tr_med = statistics.median(rm), statistics.median(tr)
    inject = [a for a, _ in spikes]
    event = [b for _, b in spikes]
    print(f"start → first step, ringmaster: median {rm_med:.2f} s  (trials {rm})")
    print(f"start → first step, torchrun:   median {tr_med:.2f} s  (trials {tr})")
    print(f"ratio ringmaster / torchrun:     {rm_med / tr_med:.2f}")
    print(
        f"fault applied → job paused:      median {statistics.median(inject) * 1000:.0f} ms, "
        f"max {max(inject) * 1000:.0f} ms over {len(inject)}"
    )
    print(
        f"spike event → job paused:        median {statistics.median(event) * 1000:.0f} ms, "
        f"max {max(event) * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
