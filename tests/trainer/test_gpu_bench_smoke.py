"""``bench/gpu.py --smoke``: the GPU benchmark's every section, tiny and on CPU, so the
script a lent GPU runs is known to work before the device time is spent. The in-process
sections run quickly; the product path (a local cluster running real jobs) takes a minute
or two on CPU and is the bench's own check (``--smoke --sections env product``, exit 1
naming what falls short: ``bench/gpu_smoke_check.py``, whose checks are tested in
``tests/bench/test_gpu_smoke_check.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("env", "bf16", "fp8-tensorwise", "fp8-rowwise", "fp8-trainer")


def smoke(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[dict[str, Any], str]:
    """Run ``bench/gpu.py --smoke *args``; its JSON result and its stdout (the table)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--smoke", *args],
        cwd=tmp_path,
        env={**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "gpu_bench.json").read_text()), proc.stdout


def test_gpu_bench_smoke_writes_every_section(tmp_path: Path) -> None:
    result, stdout = smoke(tmp_path)

    checkpoints = ("checkpoint", "checkpoint_dcp")
    assert result["status"] == dict.fromkeys((*SECTIONS, "loss_agreement", *checkpoints), "ok")
    assert result["settings"]["smoke"] is True
    assert result["env"]["torch"] and "nvml" in result["env"]
    for mode in SECTIONS[1:]:
        run = result["throughput"][mode]
        assert run["steps_run"] == len(run["losses"]) == result["settings"]["steps"]
        assert run["tokens_per_s"] > 0 and run["ms_per_step_median"] > 0
        assert run["all_finite"]
        # 2 blocks x 4 linears; "auto" (fp8-trainer) keeps tiny's small ones in high precision
        assert run["float8_linears"] == (
            8 if mode.startswith("fp8-") and mode != "fp8-trainer" else 0
        )
    for mode in SECTIONS[2:]:
        agreement = result["loss_agreement"][mode]
        assert 0 <= agreement["max_abs_delta"] < 0.1  # same weights, same data
    for name, path in zip(checkpoints, ("host buffers", "dcp"), strict=True):
        ckpt = result[name]
        assert ckpt["path"] == path
        assert ckpt["blocked_s"] > 0 and ckpt["ratio"] > 0 and ckpt["state_gb"] > 0
        assert ckpt["background_alloc_s"] > 0 and ckpt["first_blocked_s"] > 0
    assert "product" not in result["status"]  # the bench's own check
    assert "skipped" not in stdout and "elapsed_s" in stdout  # the final table


def test_product_plans_submit_valid_job_files(tmp_path: Path) -> None:
    """The GPU plan cannot run here: its job files at least decode as the coordinator
    will decode them, with the bench's compile cache in the ranks' environment."""
    import msgspec

    from bench.gpu_product import job_toml, plan
    from proto.job import JobSpec
    from trainer.presets import get_preset

    for smoke in (False, True):
        settings, jobs = plan(smoke)
        for job in jobs:
            text = job_toml(job, settings, tmp_path / "ckpt", tmp_path / "cache")
            spec = msgspec.toml.decode(text.encode(), type=JobSpec)
            assert (spec.job.name, spec.train.model) == (job.label, job.preset)
            assert spec.job.env["RINGMASTER_COMPILE_CACHE"] == str(tmp_path / "cache")
            assert spec.train.seq_len <= get_preset(job.preset).max_seq_len
            assert spec.policy.max_restarts == (1 if job.kill_at else 0)
            assert spec.train.log_every == 1
    _, gpu = plan(smoke=False)
    assert {(j.preset, j.precision) for j in gpu} == {
        ("350m", "fp8"),  # the rank killed: seconds to the next step
        ("1b3", "bf16"),
        ("1b3", "fp8"),
        ("3b", "bf16"),
        ("3b", "fp8"),
    }


def test_rank_log_medians_skip_each_processes_first_steps() -> None:
    from bench.gpu_product import read_rank_log

    def step(n: int, tok_s: int) -> str:
        return f"trainer t=1.00 rank=0 event=step step={n} loss=5.1 step_s=0.5 tok_s={tok_s}"

    lines = [
        "trainer t=0.10 rank=0 event=float8 recipe=auto linears=blocks.*.mlp.fc count=2 "
        "shape=128x512 runs_in=tensorwise why=tensorwise-pays",
        "trainer t=0.20 rank=0 event=start step=0 target=9",
        step(1, 10),
        step(2, 500),
        "trainer t=2.00 rank=0 event=compiled step=2 compile_s=31.5",
        step(3, 1000),
        step(4, 1200),
        "trainer t=9.00 rank=0 event=start step=4 target=9",  # a restart
        step(5, 20),
        step(6, 900),
        step(7, 1100),
    ]
    read = read_rank_log("\n".join(lines), warmup=2)
    assert (read["processes"], read["median_steps"], read["tokens_per_s"]) == (2, 3, 1100.0)
    assert read["compile_s"] == [31.5] and read["mfu"] is None
    assert read["float8"] == ["blocks.*.mlp.fc=tensorwise"]
