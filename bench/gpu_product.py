"""The product-path section of ``bench/gpu.py``: the trainer as Ringmaster runs it.

A local cluster (``coordinatorctl up --nodes 1 --gpus-per-node 1``: embedded NATS, the
hardware simulator, one real node agent, one coordinator) runs each job of the plan
through ``coordinatorctl start``, one at a time, as an operator would. The ranks are the
real ``trainer.worker`` and see the real GPU (the agent passes its environment on; the
agent's own telemetry is the simulator's stub NVML, which ``up`` always points it at).

Per job: tokens/s and MFU (median over the steps after each process's first few, from
rank 0's log, which has every step; plus the job record's own ``tokens_per_s`` and ``mfu``
from ``coordinatorctl status JOB --json`` where the coordinator provides them), the
checkpoint stalls from the ``job.checkpointed`` events (``coordinatorctl tail --no-follow
--json``), ``compile_s`` (rank 0's ``compiled`` log line: the value its StepDone carried),
the float8 plan and the goodput buckets. A job of the plan either runs to its target
(``finish``: its final checkpoint included) or is ended by the bench once it has reached
its step count: its ranks get SIGTERM (the job has ``max_restarts = 0``, so it then fails
instead of restarting), which skips the final checkpoint of a large model the figures do
not need. The compile cache (``RINGMASTER_COMPILE_CACHE``, in the job's env) is the
bench's own directory, cleared before a job marked ``cold_cache``: the same job twice, cold
then warm, gives a restart's compile time with and without the node's cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringmaster.logfmt import lines
from ringmaster.procs import read_pid
from trainer.presets import get_preset, param_count

TERMINAL = ("completed", "failed", "stopped")


@dataclass(frozen=True)
class Job:
    label: str  # also the job's name
    preset: str
    precision: str
    steps: int  # the target when ``finish``, else the step at which the bench ends it
    every_steps: int = 10**6  # checkpoint cadence (the default: none before the end)
    finish: bool = False
    cold_cache: bool = False
    fp8_recipe: str = "auto"
    # SIGKILL the rank once this step is durable, and time the restart: the seconds from
    # the kill to the first step of the next attempt (rank 0's log, ``wall=``)
    kill_at: int | None = None
    seq_len: int | None = None  # the plan's, unless the preset needs shorter


@dataclass(frozen=True)
class Settings:
    """What every job of a plan shares."""

    seq_len: int
    micro_batch: int
    engine: str = "deepspeed"
    zero_stage: int = 1
    compile: bool | None = None  # None: the trainer's default (on with CUDA)
    auto_micro_batch: bool = True
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the ranks
    warmup: int = 3  # steps of each process left out of the medians


def plan(smoke: bool) -> tuple[Settings, list[Job]]:
    """On the GPU: 1b3 bf16 cold (checkpoints every 12 steps), the same job again warm
    (compile_s only), 1b3 fp8, 3b bf16 and 3b fp8. ``smoke``: the same shape on the CPU
    with the tiny preset, compiled with the cheap ``aot_eager`` backend."""
    if smoke:
        settings = Settings(
            seq_len=32,
            micro_batch=2,
            compile=True,
            auto_micro_batch=False,
            env={"RINGMASTER_TEST_COMPILE_BACKEND": "aot_eager", "OMP_NUM_THREADS": "1"},
            warmup=2,
        )
        return settings, [
            Job("tiny-bf16", "tiny", "bf16", steps=8, every_steps=3, finish=True, cold_cache=True),
            Job("tiny-bf16-restart", "tiny", "bf16", steps=3),
            Job("tiny-fp8", "tiny", "fp8", steps=6, fp8_recipe="tensorwise"),
            Job("tiny-fp8-kill", "tiny", "fp8", steps=8, every_steps=3, kill_at=3),
        ]
    return Settings(seq_len=2048, micro_batch=8), [
        Job("350m-fp8-kill", "350m", "fp8", steps=30, every_steps=10, kill_at=10, seq_len=1024),
        Job("1b3-bf16", "1b3", "bf16", steps=36, every_steps=12, finish=True, cold_cache=True),
        Job("1b3-bf16-restart", "1b3", "bf16", steps=3),
        Job("1b3-fp8", "1b3", "fp8", steps=20),
        Job("3b-bf16", "3b", "bf16", steps=15),
        Job("3b-fp8", "3b", "fp8", steps=15),
    ]


def job_toml(job: Job, settings: Settings, checkpoint_dir: Path, cache: Path) -> str:
    """The job file ``coordinatorctl start`` submits."""
    env = {"RINGMASTER_COMPILE_CACHE": str(cache), **settings.env}
    train: dict[str, Any] = {
        "model": job.preset,
        "steps": job.steps if job.finish else 10**6,
        "precision": job.precision,
        "fp8_recipe": job.fp8_recipe,
        "engine": settings.engine,
        "zero_stage": settings.zero_stage,
        "micro_batch_size": settings.micro_batch,
        "auto_micro_batch": settings.auto_micro_batch,
        "seq_len": job.seq_len or settings.seq_len,
        "compile": settings.compile,
        "log_every": 1,
    }
    sections = {
        "job": {"name": job.label, "nodes": 1, "gpus_per_node": 1, "env": env},
        "train": train,
        "checkpoint": {"every_steps": job.every_steps, "dir": str(checkpoint_dir), "keep": 1},
        "policy": {"max_restarts": 1 if job.kill_at else 0},
    }
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items() if value is not None]
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)  # ints, and strings (JSON escapes are TOML basic-string ones)


def read_rank_log(text: str, warmup: int) -> dict[str, Any]:
    """Rank 0's figures from its log (logfmt lines, every step logged): the medians skip
    the first ``warmup`` steps of each process (a restart starts counting again)."""
    steps: list[dict[str, str]] = []
    out: dict[str, Any] = {"compile_s": [], "float8": [], "processes": 0}
    since_start = 0
    for fields in lines(text):
        event = fields.get("event")
        if event == "start":
            out["processes"] += 1
            since_start = 0
        elif event == "step":
            since_start += 1
            if since_start > warmup:
                steps.append(fields)
        elif event == "compiled":
            out["compile_s"].append(float(fields["compile_s"]))
        elif event == "float8":
            out["float8"].append(f"{fields['linears']}={fields['runs_in']}")
        elif event in ("model", "micro_batch") and event not in out:
            out[event] = {k: v for k, v in fields.items() if k not in ("t", "rank", "event")}
    out["median_steps"] = len(steps)
    for key, name in (("tok_s", "tokens_per_s"), ("mfu", "mfu"), ("step_s", "step_s")):
        values = [float(s[key]) for s in steps if key in s]
        out[name] = statistics.median(values) if values else None
    return out


class Cluster:
    """``coordinatorctl`` (as ``python -m coordinator.ctl.main``) on a local cluster in
    ``home``; jobs are submitted from ``workdir`` (their working directory)."""

    def __init__(self, home: Path, workdir: Path) -> None:
        self.home = home
        self.workdir = workdir
        self.env = {**os.environ, "RINGMASTER_HOME": str(home), "PYTHONUNBUFFERED": "1"}

    def __call__(self, *args: str, timeout: float = 180) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "coordinator.ctl.main", *args],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"coordinatorctl {' '.join(args)}: {done.stderr.strip()[-500:]}")
        return done.stdout

    def status(self, job: str) -> dict[str, Any]:
        status: dict[str, Any] = json.loads(self("status", job, "--json"))
        return status

    def stalls(self, job: str) -> list[tuple[int, float]]:
        out = self("tail", "--no-follow", "--json", "--kind", "job.checkpointed", "--job", job)
        events = [json.loads(line) for line in out.splitlines() if line.strip()]
        return sorted((e["step"], e["stall_s"]) for e in events)

    def job_files(self, job: str, pattern: str) -> list[Path]:
        return sorted(self.home.glob(f"nodes/*/agent/jobs/{job}/{pattern}"))

    def end(self, job: str, sig: signal.Signals = signal.SIGTERM) -> None:
        """Signal the job's ranks (their process groups), as a failure would."""
        for pidfile in self.job_files(job, "rank-*.pid"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if (pid := read_pid(pidfile)) is not None:
                    os.killpg(pid, sig)


def run_job(
    cluster: Cluster, job: Job, settings: Settings, ckpt_root: Path, cache: Path, deadline: float
) -> dict[str, Any]:
    """Submit ``job``, follow it until it ends (or the bench ends it), read its figures."""
    if job.cold_cache:
        shutil.rmtree(cache, ignore_errors=True)
    path = cluster.workdir / f"{job.label}.toml"
    path.write_text(job_toml(job, settings, ckpt_root / job.label, cache))
    started = time.monotonic()
    job_id = cluster("start", str(path)).strip()
    ended_by, ended_at, killed_at = None, 0.0, None
    while (status := cluster.status(job_id))["state"] not in TERMINAL:
        durable = status.get("last_checkpoint_step") or 0
        if job.kill_at and killed_at is None and time.monotonic() < deadline:
            if durable >= job.kill_at:
                killed_at = time.time()
                cluster.end(job_id, signal.SIGKILL)
            time.sleep(0.1)
            continue  # not ended before the kill, nor before the next attempt trains
        restarted = not job.kill_at or _trained_again(cluster, job_id, killed_at)
        if ended_by is None and not job.finish and status["step"] >= job.steps and restarted:
            ended_by = "bench, at its step count"
        elif ended_by is None and time.monotonic() > deadline:
            ended_by = "bench, at the deadline"
        if ended_by is not None:
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > 60:
                raise RuntimeError(f"{job_id} did not end within 60 s of SIGTERM to its ranks")
            cluster.end(job_id)
        time.sleep(0.5)
    logs = cluster.job_files(job_id, "rank-0.log")
    text = logs[0].read_text(errors="replace") if logs else ""
    stalls = cluster.stalls(job_id)
    shutil.rmtree(ckpt_root / job.label, ignore_errors=True)
    return {
        "job": job_id,
        "state": status["state"],
        "reason": status.get("reason", ""),
        "ended_by": ended_by or "itself",
        "steps": status["step"],
        "wall_s": time.monotonic() - started,
        **read_rank_log(text, settings.warmup),
        "status_tokens_per_s": status.get("tokens_per_s"),
        "status_mfu": status.get("mfu"),
        "checkpoint_stalls_s": stalls,
        "first_stall_s": stalls[0][1] if stalls else None,
        "later_stall_s": statistics.median(s for _, s in stalls[1:]) if stalls[1:] else None,
        "goodput": status.get("goodput"),
        "rank0_log_tail": text.splitlines()[-3:] if status["state"] == "failed" else [],
        **({"restart": restart_figures(text, killed_at)} if job.kill_at else {}),
    }


def _trained_again(cluster: Cluster, job_id: str, killed_at: float | None) -> bool:
    """The next attempt's rank 0 has logged a step since the kill."""
    logs = cluster.job_files(job_id, "rank-0.log")
    text = logs[0].read_text(errors="replace") if logs else ""
    return restart_figures(text, killed_at).get("seconds_to_next_step") is not None


def restart_figures(text: str, killed_at: float | None) -> dict[str, Any]:
    """From rank 0's log (every line has ``wall=``): the seconds from the kill to each
    phase of the next attempt's rank 0 and to its first step, and the steps redone."""
    if killed_at is None:
        return {"error": "the rank was never killed (no durable checkpoint at kill_at)"}
    out: dict[str, Any] = {}
    before = 0
    for fields in lines(text):
        if "wall" not in fields:
            continue
        wall, event = float(fields["wall"]), fields.get("event", "")
        if wall <= killed_at:
            before = int(fields["step"]) if event == "step" else before
            continue
        if event == "start":
            out.setdefault("resumed_from", int(fields.get("step", 0)))
        elif event == "step" and "resumed_from" not in out:
            continue  # the killed process's last words, not the next attempt's
        key = f"{event}_s"
        if event in ("started", "process_group", "model_built", "model", "start", "step"):
            out.setdefault(key, round(wall - killed_at, 2))
        if event == "step":
            break
    out["seconds_to_next_step"] = out.get("step_s")
    out["steps_redone"] = before - out["resumed_from"] if "resumed_from" in out else None
    return out


def checkpoint_root(base: Path, jobs: list[Job]) -> Path:
    """``/dev/shm`` (RAM: fast, so a stall never waits for a slow disk) when it can hold two
    checkpoints (about 16 bytes a parameter) of the largest preset that checkpoints at all
    (a job ended before its first checkpoint writes none), else ``base``."""
    writing = [j for j in jobs if j.finish or j.every_steps <= j.steps]
    need = 2 * 16 * max((param_count(get_preset(j.preset)) for j in writing), default=0)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1.2 * need:
        return shm / f"ringmaster-gpu-bench-{os.getpid()}"
    return base


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """fp8 against bf16 for each preset measured both ways, and cold against warm compile."""
    done = {label: r for label, r in results.items() if isinstance(r, dict)}
    out: dict[str, Any] = {}
    for label, res in done.items():
        if not label.endswith("-bf16"):
            continue
        preset = label.removesuffix("-bf16")
        fp8 = done.get(f"{preset}-fp8")
        if fp8 and res.get("tokens_per_s") and fp8.get("tokens_per_s"):
            ratio = fp8["tokens_per_s"] / res["tokens_per_s"]
            out[f"{preset}_fp8_over_bf16"] = ratio
            out[f"{preset}_fp8_ge_bf16"] = ratio >= 1.0
    for label, res in done.items():
        warm = done.get(f"{label}-restart")
        if warm and res["compile_s"] and warm["compile_s"]:
            out[f"{label}_compile_s_cold"] = res["compile_s"][0]
            out[f"{label}_compile_s_warm"] = warm["compile_s"][0]
    return out


def product(
    root: Path, smoke: bool, deadline: float, job_min_s: float, skipped: str
) -> dict[str, Any]:
    """Bring a local cluster up under ``root``, run the plan, bring it down. Each job starts
    only with ``job_min_s`` seconds left to the deadline; a job still running at the
    deadline is ended there."""
    settings, jobs = plan(smoke)
    home, workdir = root / "home", root / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt_root = checkpoint_root(workdir, jobs)
    cache = root / "compile-cache"
    cluster = Cluster(home, workdir)
    results: dict[str, Any] = {"settings": {**settings.__dict__, "checkpoints": str(ckpt_root)}}
    cluster("up", "--nodes", "1", "--gpus-per-node", "1")
    try:
        for job in jobs:
            if time.monotonic() + job_min_s > deadline:
                results[job.label] = skipped
                continue
            results[job.label] = run_job(cluster, job, settings, ckpt_root, cache, deadline)
    finally:
        cluster("down")
        if ckpt_root != workdir:
            shutil.rmtree(ckpt_root, ignore_errors=True)
    results["summary"] = summarise(results)
    return results
