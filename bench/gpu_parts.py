"""The measuring parts of ``bench/gpu.py``: NVML readings, one training run per precision
mode, and the checkpoint stall. Imported by that script only (it puts the repo on sys.path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from trainer.compile import compile_blocks
from trainer.data import SYNTHETIC, Batches, Layout
from trainer.flops import model_flops_per_token
from trainer.fp8_auto import Fp8Recipe
from trainer.model import GPT, count_params, lm_loss
from trainer.precision import apply_precision, autocast_context, count_float8_linears
from trainer.presets import ModelConfig

GIB = 1 << 30
# bf16 and fp8-*: fp32 master weights under bf16 autocast; fp8-* also turn every in-block
# linear into a torchao Float8Linear with that scaling. fp8-trainer is the job default,
# train.fp8_recipe = "auto" (per linear: tensorwise, rowwise or BF16, by shape).
MODES = ("bf16", "fp8-tensorwise", "fp8-rowwise", "fp8-trainer")
FP8_RECIPES: dict[str, Fp8Recipe] = {
    "fp8-tensorwise": "tensorwise",
    "fp8-rowwise": "rowwise",
    "fp8-trainer": "auto",
}


@dataclasses.dataclass(frozen=True)
class Run:
    """What every mode's run shares."""

    cfg: ModelConfig
    device: torch.device
    seq_len: int
    steps: int
    warmup: int
    lr: float
    grad_clip: float
    seed: int
    compile: bool
    emulate: bool


class Nvml:
    """GPU 0 through NVML: the node agent's own GpuCollector (temperature, clock-event
    reasons, utilisation, memory), plus power and clocks through its ``optional`` helper.
    Without the agent's imports (msgspec, nats-py), plain pynvml and a raw reason mask."""

    def __init__(self) -> None:
        self.error = ""
        self.via = "nodeagent.collectors.gpu.GpuCollector"
        self.collector: Any = None
        try:
            import pynvml
        except ImportError as exc:
            self.error = f"no pynvml: {exc}"
            return
        self.nv: Any = pynvml
        try:
            from nodeagent.collectors.gpu import GpuCollector
            from nodeagent.collectors.nvml import NvmlSession, optional
        except (Exception, SystemExit) as exc:  # ImportError, or proto's guard
            self.via = f"pynvml direct (nodeagent import failed: {exc!r})"
            self.optional = self._optional
        else:
            self.collector = GpuCollector(NvmlSession())
            self.optional = optional
        try:
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:
            self.error = f"no NVML: {exc}"

    def _optional(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except self.nv.NVMLError:
            return None

    def read(self) -> dict[str, Any]:
        """One reading of GPU 0; a failure is reported in the reading, never raised."""
        if self.error:
            return {"error": self.error}
        try:
            return self._read()
        except Exception as exc:
            return {"via": self.via, "error": repr(exc)}

    def _read(self) -> dict[str, Any]:
        nv, opt, h = self.nv, self.optional, self.handle
        out: dict[str, Any] = {"via": self.via}
        if self.collector is not None:
            values = msgspec.to_builtins(self.collector.collect(time.time()))
            gpu = values["gpus"][0]
            out |= {"driver": values["driver"], **gpu.pop("identity"), **gpu}
            out["xid_watch"], out["xids"] = values["xid_watch"], values["xids"]
        else:
            out["driver"] = opt(nv.nvmlSystemGetDriverVersion)
            out["temp_c"] = opt(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            mask = opt(nv.nvmlDeviceGetCurrentClocksEventReasons, h)
            out["clock_reasons"] = None if mask is None else hex(mask)
        power, limit = (
            opt(nv.nvmlDeviceGetPowerUsage, h),
            opt(nv.nvmlDeviceGetEnforcedPowerLimit, h),
        )
        out["power_w"] = None if power is None else power / 1000
        out["power_limit_w"] = None if limit is None else limit / 1000
        for name, clock in (("sm", nv.NVML_CLOCK_SM), ("mem", nv.NVML_CLOCK_MEM)):
            out[f"{name}_clock_mhz"] = opt(nv.nvmlDeviceGetClockInfo, h, clock)
            out[f"{name}_clock_max_mhz"] = opt(nv.nvmlDeviceGetMaxClockInfo, h, clock)
        return out

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()


def reset_compiled() -> None:
    """Drop torch.compile's caches (each mode builds new modules)."""
    import torch._dynamo

    torch._dynamo.reset()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build(mode: str, run: Run) -> tuple[GPT, Callable[[], Any]]:
    """The seeded model of ``mode`` on the device (identical weights for every mode) and
    the context its forward runs under."""
    torch.manual_seed(run.seed)
    with run.device:
        model = GPT(run.cfg)
    if mode.startswith("fp8-"):
        apply_precision(model, "fp8", run.device, FP8_RECIPES[mode], emulate=run.emulate)
    return model, autocast_context("bf16", run.device)


def train(mode: str, run: Run, micro_batch: int, deadline: float, nvml: Nvml) -> dict[str, Any]:
    """``run.steps`` AdamW steps as DDPEngine.step takes them (world size 1, no DDP wrapper):
    per-step device time from CUDA events (host clock on CPU), losses read only at the end."""
    model, autocast = build(mode, run)
    n_params = count_params(model)
    fp8_linears = count_float8_linears(model)
    if run.compile:  # regional: one compiled graph serves all the identical blocks
        compile_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr)
    batches = Batches(
        SYNTHETIC,
        seq_len=run.seq_len,
        vocab_size=run.cfg.vocab_size,
        seed=run.seed,
        layout=Layout(micro_batch, 1),
        rank=0,
    )
    data = [tuple(t.to(run.device) for t in batches.batch(s)) for s in range(run.steps)]
    cuda = run.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    marks: list[Any] = []
    losses: list[torch.Tensor] = []
    under_load: dict[str, Any] = {}
    first_step_s = timed_start = 0.0
    start = time.perf_counter()
    for step, (inputs, targets) in enumerate(data):
        if step > run.warmup and time.monotonic() > deadline:
            break
        if step == run.warmup:
            sync()
            timed_start = time.perf_counter()
        marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
        if cuda:
            marks[-1].record()
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            logits = model(inputs)
        loss = lm_loss(logits, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.grad_clip)
        optimizer.step()
        losses.append(loss.detach())
        if step == 0:
            sync()
            first_step_s = time.perf_counter() - start  # includes compiling, if on
        if step == run.warmup + (run.steps - run.warmup) // 2:
            under_load = nvml.read()  # the device still has queued work here
    marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
    if cuda:
        marks[-1].record()
    sync()
    wall = time.perf_counter() - timed_start
    if cuda:
        durations = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]
    else:
        durations = [b - a for a, b in itertools.pairwise(marks)]
    timed = durations[run.warmup :]
    values = [float(v) for v in torch.stack(losses).float().cpu()]
    tokens = micro_batch * run.seq_len
    flops = model_flops_per_token(run.cfg, run.seq_len)  # 6N + PaLM's attention term
    median = statistics.median(timed) if timed else None
    return {
        "micro_batch": micro_batch,
        "seq_len": run.seq_len,
        "steps_run": len(losses),
        "timed_steps": len(timed),
        "stopped_by_deadline": len(losses) < run.steps,
        "ms_per_step_median": None if median is None else 1e3 * median,
        "ms_per_step_wall_mean": 1e3 * wall / len(timed) if timed else None,
        "tokens_per_s": None if median is None else tokens / median,
        "model_tflops": None if median is None else flops * tokens / median / 1e12,
        "first_step_s": first_step_s,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
        "params": n_params,
        "float8_linears": fp8_linears,
        "losses": values,
        "all_finite": all(v == v and abs(v) != float("inf") for v in values),
        "nvml_under_load": under_load,
    }


def train_backing_off(
    mode: str, run: Run, micro_batch: int, deadline: float, nvml: Nvml
) -> dict[str, Any]:
    """:func:`train`, halving the micro-batch after each CUDA out-of-memory error."""
    ooms: list[int] = []
    while True:
        try:
            return {**train(mode, run, micro_batch, deadline, nvml), "oom_at": ooms}
        except torch.cuda.OutOfMemoryError:
            if micro_batch == 1:
                raise
            ooms.append(micro_batch)
        if run.compile:
            reset_compiled()
        free_memory(run.device)  # outside the handler: its traceback no longer pins tensors
        micro_batch //= 2


def filesystem(path: Path) -> str:
    """The type and device of the mount holding ``path`` (from /proc/mounts)."""
    best = ("", "?")
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            device, point, kind = line.split()[:3]
            if str(path.resolve()).startswith(point) and len(point) >= len(best[0]):
                best = (point, f"{kind} ({device} on {point})")
    return best[1]


def checkpoint_stall(
    run: Run, root: Path, repeats: int, deadline: float, dcp: bool = False
) -> dict[str, Any]:
    """The real Checkpointer (world size 1) on the model's and AdamW's state after one bf16
    step: seconds the loop is blocked against the whole save done synchronously (snapshot,
    write, sha256, fsync, manifest). ``dcp``: the DDP/FSDP engines' path (DCP
    ``async_save`` staging into pinned host buffers, on a one-rank gloo group); else the
    DeepSpeed engine's capture (state dicts copied into reused host buffers, torch.save).
    As in the trainer, the host buffers are allocated in the background before the first
    checkpoint (``background_alloc_s``, waited for here: a run keeps training meanwhile),
    so ``first_blocked_s`` should be close to the later ``blocked_s``."""
    import torch.distributed as dist

    from ringmaster.rank import durable
    from ringmaster.rank.checkpoint import Checkpointer, HostBuffers, default_staging_dir
    from ringmaster.rank.coordination import Coordination
    from ringmaster.rank.dcp_async import DcpState

    model, autocast = build("bf16", run)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr)
    tokens = torch.randint(run.cfg.vocab_size, (1, run.seq_len + 1), device=run.device)
    with autocast():
        logits = model(tokens[:, :-1])
    lm_loss(logits, tokens[:, 1:]).backward()
    optimizer.step()  # creates exp_avg and exp_avg_sq
    buffers = HostBuffers()
    shard, trainer_file = durable.shard_name(0), durable.trainer_file(0)
    if dcp and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dcp_state = DcpState(model, optimizer, None) if dcp else None

    def stage(directory: Path, target: Path) -> dict[str, Any]:  # Trainer._snapshot
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        step = {trainer_file: {"step": 1, "rng": rng}}
        if dcp_state is not None:
            return {**dcp_state.snapshot(target), **step}
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        return {shard: buffers.copy(state, shard), **step}

    def state_bytes(step_dir: Path) -> int:
        manifest = durable.read_manifest(step_dir)
        assert manifest is not None
        return sum(e.size for n, e in manifest.files.items() if n != trainer_file)

    started = time.monotonic()  # Engine.prepare_snapshot, after the first step
    if dcp_state is not None:
        dcp_state.prepare()
        dcp_state.wait_prepared()
    else:
        buffers.reserve({shard: {"model": model.state_dict(), "optimizer": optimizer.state_dict()}})
        buffers.wait()
    background_alloc_s = time.monotonic() - started
    staging = default_staging_dir("gpu-bench", root)
    ckpt = Checkpointer(root / "ckpt", staging, Coordination(), keep=1, engine="ddp")
    blocked: list[float] = []
    full: list[float] = []
    predeleted = 0
    for step in range(1, repeats + 2):
        if step > 1:
            if time.monotonic() + 1.5 * full[-1] > deadline:
                break
            previous = root / "ckpt" / durable.step_dir_name(step - 1)
            if shutil.disk_usage(root).free < 1.5 * state_bytes(previous):
                shutil.rmtree(previous)  # keep=1 would prune it only after the next commit
                predeleted += 1
        start = time.monotonic()
        blocked.append(ckpt.save(step, stage))
        ckpt.wait()
        full.append(time.monotonic() - start)
        if ckpt.durable_step != step:
            raise RuntimeError(f"checkpoint step {step} did not become durable")
    ckpt.close()
    size = state_bytes(root / "ckpt" / durable.step_dir_name(len(full)))
    if dcp_state is not None:
        dcp_state.close()
    free_gb = shutil.disk_usage(root).free / 1e9
    b, f = statistics.median(blocked[1:] or blocked), statistics.median(full[1:] or full)
    return {
        "state_gb": size / 1e9,
        "path": "dcp" if dcp else "host buffers",
        "host_buffers_gb": buffers.nbytes / 1e9 if not dcp else None,
        "background_alloc_s": background_alloc_s,
        "first_blocked_s": blocked[0],
        "first_full_s": full[0],
        "blocked_s": b,
        "full_sync_save_s": f,
        "ratio": b / f,
        "repeats": len(full) - 1,
        "durable_dir": str(root / "ckpt"),
        "durable_fs": filesystem(root),
        "disk_free_gb_after": free_gb,
        "previous_deleted_for_space": predeleted,
        "staging_dir": str(staging),
    }
