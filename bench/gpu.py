"""Trainer figures on one NVIDIA GPU (written for a lent H200), in one call of under 8 minutes:

1. environment: torch / torchao / CUDA versions, device name and compute capability (real
   float8 matmuls, ``torch._scaled_mm``, need >= 9.0 here), and NVML through the node
   agent's own GpuCollector (driver, temperature, power, clocks, clock-event reasons);
2. throughput of the "1b3" preset (~1.3 B parameters) per precision mode: ``bf16`` (fp32
   master weights, bf16 autocast), ``fp8-tensorwise`` and ``fp8-rowwise`` (the same, with
   the in-block linears converted by torchao's ``convert_to_float8_training`` through
   ``trainer.precision``'s module filter, emulate=False); optional ``fp8-trainer`` (the
   trainer's own fp8 path: tensorwise, no autocast). Median ms/step over the timed steps
   (CUDA events, after warm-up), tokens/s, model TFLOP/s, peak memory; the blocks are
   compiled (torch.compile per block, once for all) unless --no-compile; a CUDA OOM halves
   the micro-batch and retries;
3. loss agreement: every mode trains the same seeded weights on the same synthetic batches,
   so the steps timed in 2 are also the loss run: final losses and max |Δloss| over the last
   10 steps against bf16;
4. checkpoint stall: the real ``trainer.checkpoint.Checkpointer`` (world size 1) on the
   model's and AdamW's state (~16 GB): the blocking snapshot against a whole synchronous
   save (durable dir under /tmp, deleted afterwards), first through the DeepSpeed
   engine's host-buffer capture, then (time permitting) the DDP/FSDP engines' DCP
   ``async_save`` with pinned staging.

Prints one table at the end and writes it as JSON to ``$OUT/gpu_bench.json`` (``$OUT``
unset: ``./gpu_bench.json``), rewritten after every section. Past the deadline (--deadline,
from start) the remaining sections print "skipped (deadline)"; a section that fails is
reported and the next one runs.

On the device machine (its python3 has torch, numpy, pynvml; it lacks torchao, msgspec
(trainer.durable) and nats-py (the node agent's collectors)), carry them as wheels. Once,
here, in the repo root (``/.whl/`` is already git-ignored)::

    .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        -d .whl torchao==0.18.0 msgspec==0.22.0 nats-py==2.16.0

then run with ``carry: [".whl"]``, timeout_s 480::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
    PYTHONUNBUFFERED=1 python3 bench/gpu.py

Here, on CPU: ``.venv/bin/python bench/gpu.py --smoke`` (tiny preset, emulated fp8, no
compile; every section runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

STARTED = time.monotonic()  # the deadline counts from here: torch's import is inside it
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.gpu_parts import (  # noqa: E402
    MODES,
    Nvml,
    Run,
    checkpoint_stall,
    free_memory,
    reset_compiled,
    train_backing_off,
)
from trainer.presets import get_preset  # noqa: E402

SKIPPED = "skipped (deadline)"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="1b3")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES[:3]))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8, help="halved on CUDA OOM")
    p.add_argument("--steps", type=int, default=50, help="per mode, warm-up included")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps (compile happens here)")
    p.add_argument("--loss-window", type=int, default=10, help="last steps compared to bf16")
    p.add_argument("--lr", type=float, default=3e-4, help="TrainSection's default")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--emulate", action="store_true", help="fp8 matmuls in high precision")
    p.add_argument("--ckpt-repeats", type=int, default=2, help="saves after the allocating one")
    p.add_argument("--ckpt-root", type=Path, default=Path("/tmp/ringmaster-gpu-bench"))
    p.add_argument("--deadline", type=float, default=420.0, help="seconds from start")
    p.add_argument("--min-left", type=float, default=30.0, help="start no section with less")
    p.add_argument("--smoke", action="store_true", help="tiny, on CPU: checks every path")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.seq_len, args.micro_batch, args.steps = "tiny", 32, 2, 6
        args.warmup, args.loss_window, args.ckpt_repeats, args.min_left = 2, 3, 1, 0.0
        args.compile, args.emulate, args.modes = False, True, list(MODES)
    return args


def environment(device: torch.device, nvml: Nvml) -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchao": version("torchao"),
        "cuda": torch.version.cuda,
        "device": str(device),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {
            "name": torch.cuda.get_device_name(device),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
            "sms": props.multi_processor_count,
            "memory_gib": props.total_memory / (1 << 30),
            "cudnn": torch.backends.cudnn.version(),
        }
    env["nvml"] = nvml.read()
    return env


def loss_agreement(modes: dict[str, Any], window: int) -> dict[str, Any]:
    base = modes.get("bf16")
    if not isinstance(base, dict):
        return {"error": "no bf16 run to compare with"}
    out: dict[str, Any] = {"bf16": {"final": base["losses"][-1]}}
    for name, res in modes.items():
        if name == "bf16" or not isinstance(res, dict):
            continue
        if res["micro_batch"] != base["micro_batch"]:
            out[name] = {"error": "micro-batch differs from bf16's (OOM back-off)"}
            continue
        n = min(len(res["losses"]), len(base["losses"]))
        pairs = list(zip(res["losses"][:n], base["losses"][:n], strict=True))[-window:]
        out[name] = {
            "final": res["losses"][-1],
            "compared_steps": f"{n - len(pairs) + 1}-{n}",
            "max_abs_delta": max(abs(a - b) for a, b in pairs),
            "max_rel_delta": max(abs(a - b) / abs(b) for a, b in pairs),
        }
    return out


def table(result: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
        if isinstance(v, dict):
            return ", ".join(f"{k}={fmt(x)}" for k, x in v.items() if k != "losses")
        return str(v)

    rows = [("settings", k, fmt(v)) for k, v in result["settings"].items()]
    for section in ("env", "throughput", "loss_agreement", "checkpoint", "checkpoint_dcp"):
        value = result.get(section)
        if isinstance(value, dict):
            rows += [(section, k, fmt(v)) for k, v in value.items()]
        if section in result["status"] and result["status"][section] != "ok":
            rows.append((section, "status", result["status"][section]))
    rows.append(("run", "elapsed_s", fmt(result["elapsed_s"])))
    width = max(len(r[1]) for r in rows)
    return "\n".join(f"{s:<15}| {k:<{width}} | {v}" for s, k, v in rows)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    deadline = STARTED + args.deadline
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path.cwd()
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result: dict[str, Any] = {"settings": settings, "status": {}, "throughput": {}}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still print what we have

    def save() -> None:
        result["elapsed_s"] = time.monotonic() - STARTED
        (out / "gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))

    def section(name: str, fn: Any, *fn_args: Any, instant: bool = False) -> Any:
        if not instant and time.monotonic() + args.min_left > deadline:
            result["status"][name] = SKIPPED
            return None
        try:
            value = fn(*fn_args)
            result["status"][name] = "ok"
            return value
        except Exception as exc:
            traceback.print_exc()
            result["status"][name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
            return None
        finally:
            free_memory(device)
            save()

    nvml = Nvml()
    try:
        result["env"] = section("env", environment, device, nvml)
        run = Run(
            cfg=get_preset(args.preset),
            device=device,
            seq_len=args.seq_len,
            steps=args.steps,
            warmup=min(args.warmup, args.steps - 1),
            lr=args.lr,
            grad_clip=args.grad_clip,
            seed=args.seed,
            compile=args.compile,
            emulate=args.emulate or device.type != "cuda",
        )
        settings["model_config"] = str(run.cfg)
        capable = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)
        micro_batch = args.micro_batch
        for mode in args.modes:
            if mode.startswith("fp8") and not (capable or run.emulate):
                result["throughput"][mode] = "skipped: compute capability < 9.0"
                continue
            res = section(mode, train_backing_off, mode, run, micro_batch, deadline, nvml)
            result["throughput"][mode] = res if res is not None else result["status"][mode]
            if res is not None:
                micro_batch = res["micro_batch"]  # later modes start from what fitted
            if run.compile:
                reset_compiled()
        result["loss_agreement"] = section(
            "loss_agreement", loss_agreement, result["throughput"], args.loss_window, instant=True
        )
        for name, dcp in (("checkpoint", False), ("checkpoint_dcp", True)):
            root = args.ckpt_root / f"run-{os.getpid()}-{name}"
            try:
                result[name] = section(
                    name, checkpoint_stall, run, root, args.ckpt_repeats, deadline, dcp
                )
            finally:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        nvml.close()
        save()
        print(table(result), flush=True)
    failed = [k for k, v in result["status"].items() if v != "ok"]
    return 1 if failed and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
