"""The DeepSpeed engine: ZeRO stages 0–3 behind the same :class:`trainer.engine.Engine`
protocol as DDP.

DeepSpeed owns gradient reduction, clipping, the optimizer (partitioned across ranks from
stage 1) and, from stage 3, the parameters themselves. Its checkpoint is its own layout
(``ds/mp_rank_00_model_states.pt``, ``ds/zero_pp_rank_<r>_…_optim_states.pt``, …), built
by its own ``save_checkpoint`` in the loop (it takes collectives, so it cannot move to the
persist thread). Every state dict it hands its checkpoint engine's ``save`` is captured
instead of written: copied into reused host buffers (:class:`_SnapshotEngine`), so the
loop does not wait for serialisation; the few plain files it copies itself (the
``zero_to_fp32.py`` recovery scripts) land in the rank's staging dir. Persisting merges
the ranks' files into one step dir, exactly the directory ``load_checkpoint`` expects. The
durable dir must be shared by the job's nodes, as ranks load files other ranks wrote.

A ZeRO-1/2 checkpoint written at another world size (a job continuing on fewer nodes after
losing one, or grown back) loads too: the parameters through ``load_checkpoint`` without
the optimizer, which DeepSpeed refuses to re-partition, then every saved rank's optimizer
partition re-sliced by :mod:`trainer.zero_reshard`. ZeRO-3 partitions the parameters as
well and is refused at another world size (:meth:`DeepSpeedEngine.refusal`).

The host buffers are allocated ahead of the first checkpoint
(:meth:`DeepSpeedEngine.prepare_snapshot`): a dry run of ``save_checkpoint`` into a scratch
dir records, without copying, exactly the state dicts a checkpoint hands over, and a
background thread allocates (pins, on CUDA) their buffers.

On CPU, two settings avoid minutes of JIT compilation on first use: ``torch_adam`` (plain
torch AdamW instead of the fused C++ one) and disabling the ``deepspeed_shm_comm`` op.
fp8 converts the model with torchao before ``deepspeed.initialize``. bf16 is DeepSpeed's
own (bf16 weights, fp32 master copy), so no autocast here; fp8 on CUDA uses it too, so
everything around the float8 linears runs in BF16 as with bf16 (on CPU fp8 stays fp32
around them, see :mod:`trainer.precision`).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from proto.job import TrainSection
from trainer import durable, zero_reshard
from trainer.host_buffers import HostBuffers
from trainer.model import lm_loss
from trainer.precision import Precision

TAG = "ds"  # the one checkpoint tag inside every step dir


def ds_config(train: TrainSection, precision: Precision, device: torch.device) -> dict[str, Any]:
    bf16 = precision == "bf16" or (precision == "fp8" and device.type == "cuda")
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": train.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": train.lr, "torch_adam": True}},
        "zero_optimization": {"stage": train.zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,  # progress is ours to report
    }


class _SnapshotEngine:
    """Stands in for DeepSpeed's checkpoint engine during one ``save_checkpoint``: each
    ``save(state_dict, path)`` records ``keep(state_dict, name)`` (a host copy, or the live
    state itself in a dry run) under its ``name``, the path relative to ``root``;
    everything else (makedirs, create, commit, load) is the real engine's."""

    def __init__(self, inner: Any, keep: Callable[[Any, str], Any], root: Path) -> None:
        self.inner = inner
        self.keep = keep
        self.root = root
        self.objects: dict[str, Any] = {}

    def save(self, state_dict: Any, path: str) -> None:
        name = Path(path).relative_to(self.root).as_posix()
        self.objects[name] = self.keep(state_dict, name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class DeepSpeedEngine:
    def __init__(
        self,
        module: nn.Module,
        train: TrainSection,
        precision: Precision,
        device: torch.device,
        rank: int,
        world_size: int,
    ) -> None:
        import deepspeed  # seconds to import; only this engine needs it

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        self.name = f"deepspeed-zero{train.zero_stage}"
        self.zero_stage = train.zero_stage
        self.module = module
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.ds, *_ = deepspeed.initialize(
            model=module.to(device),
            model_parameters=module.parameters(),
            config=ds_config(train, precision, device),
        )
        self.buffers = HostBuffers()

    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | float | None]:
        loss = lm_loss(self.ds(inputs.to(self.device)), targets.to(self.device))
        self.ds.backward(loss)
        self.ds.step()
        norm: torch.Tensor | float | None = self.ds.get_global_grad_norm()  # with clipping on
        return loss.detach(), norm

    def snapshot(self, staging: Path, target: Path) -> dict[str, Any]:
        if self.ds.checkpoint_engine.is_decoupled():  # writes on its own schedule
            self.ds.save_checkpoint(str(staging), tag=TAG, save_latest=False)
            return {}
        return self._capture(staging, self.buffers.copy)

    def prepare_snapshot(self) -> None:
        if self.ds.checkpoint_engine.is_decoupled():
            return  # its own buffers, if any
        with tempfile.TemporaryDirectory(prefix="ringmaster-ds-dry-run-") as scratch:
            states = self._capture(Path(scratch), lambda state, name: state)
        self.buffers.reserve(states)

    def _capture(self, directory: Path, keep: Callable[[Any, str], Any]) -> dict[str, Any]:
        """Run ``save_checkpoint`` into ``directory`` with every state dict it saves
        passed through ``keep`` instead of written; returns them by file name."""
        real = self.ds.checkpoint_engine
        capture = _SnapshotEngine(real, keep, directory)
        self.ds.checkpoint_engine = capture
        try:
            self.ds.save_checkpoint(str(directory), tag=TAG, save_latest=False)
        finally:
            self.ds.checkpoint_engine = real
        return capture.objects

    def refusal(self, manifest: durable.Manifest) -> str | None:
        if manifest.engine != self.name:
            return f"another engine's (resume with {manifest.engine})"
        if manifest.world_size == self.world_size:
            return None
        if self.zero_stage == 3:
            return (
                "DeepSpeed loads ZeRO-3's partitioned parameters only at the world size that "
                f"wrote them ({manifest.world_size}); ZeRO-1 and 2 checkpoints reshard"
            )
        if self.zero_stage == 0:  # replicated, but bf16 partitions it; not worth a path
            return f"ZeRO-0 loads only at the world size that wrote it ({manifest.world_size})"
        if self._reshard_files(manifest) is None:
            return f"a ZeRO partition file of its {manifest.world_size} ranks is missing"
        return None

    def files_for(self, manifest: durable.Manifest) -> list[str] | None:
        if self.refusal(manifest) is not None:
            return None
        if manifest.world_size != self.world_size:
            return self._reshard_files(manifest)
        own = manifest.ranks.get(str(self.rank), [])
        return [name for name in own if name.startswith(f"{TAG}/")]

    def _reshard_files(self, manifest: durable.Manifest) -> list[str] | None:
        """What a rank reads to load a ZeRO-1/2 checkpoint of another world size: the model
        states and every saved rank's optimizer partition (None if one is missing)."""
        names = [name for name in manifest.files if name.startswith(f"{TAG}/")]
        zero = zero_reshard.zero_files(names, manifest.world_size)
        models = [n for n in names if zero_reshard.MODEL_STATES.fullmatch(Path(n).name)]
        return None if zero is None or not models else sorted(models) + zero

    def load(self, step_dir: Path, manifest: durable.Manifest) -> None:
        if manifest.world_size == self.world_size:
            path, _ = self.ds.load_checkpoint(str(step_dir), tag=TAG)
        else:  # the parameters as usual; DeepSpeed refuses to reshard the optimizer itself
            path, _ = self.ds.load_checkpoint(str(step_dir), tag=TAG, load_optimizer_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {step_dir}")
        if manifest.world_size != self.world_size:
            files = self._reshard_files(manifest)
            assert files is not None  # files_for checked
            zero = [step_dir / name for name in files[-manifest.world_size :]]
            zero_reshard.load_resharded(self.ds.optimizer, zero, self.rank, self.world_size)

    def close(self) -> None:
        self.buffers.wait()
        self.buffers = HostBuffers()  # drop the host copies of the last checkpoint
