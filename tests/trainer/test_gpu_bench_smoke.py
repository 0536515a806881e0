"""``bench/gpu.py --smoke``: the GPU benchmark's every section, tiny and on CPU, so the
script a lent GPU runs is known to work before the device time is spent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("env", "bf16", "fp8-tensorwise", "fp8-rowwise", "fp8-trainer")


def test_gpu_bench_smoke_writes_every_section(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--smoke"],
        cwd=tmp_path,
        env={**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_bench.json").read_text())

    checkpoints = ("checkpoint", "checkpoint_dcp")
    assert result["status"] == dict.fromkeys((*SECTIONS, "loss_agreement", *checkpoints), "ok")
    assert result["settings"]["smoke"] is True
    assert result["env"]["torch"] and "nvml" in result["env"]
    for mode in SECTIONS[1:]:
        run = result["throughput"][mode]
        assert run["steps_run"] == len(run["losses"]) == result["settings"]["steps"]
        assert run["tokens_per_s"] > 0 and run["ms_per_step_median"] > 0
        assert run["all_finite"]
        assert run["float8_linears"] == (0 if mode == "bf16" else 8)  # 2 blocks x 4 linears
    for mode in SECTIONS[2:]:
        agreement = result["loss_agreement"][mode]
        assert 0 <= agreement["max_abs_delta"] < 0.1  # same weights, same data
    for name, path in zip(checkpoints, ("host buffers", "dcp"), strict=True):
        ckpt = result[name]
        assert ckpt["path"] == path
        assert ckpt["blocked_s"] > 0 and ckpt["ratio"] > 0 and ckpt["state_gb"] > 0
    assert "skipped" not in proc.stdout and "elapsed_s" in proc.stdout  # the final table
