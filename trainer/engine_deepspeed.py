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

A ZeRO-1, 2 or 3 checkpoint written at another world size (a job continuing on fewer
nodes after losing one, or grown back) loads through DeepSpeed's own Universal
Checkpointing: rank 0 converts the step dir with ``ds_to_universal`` into
``<checkpoint.dir>/ds-universal/`` (beside the step dirs, never one of them: resume and
pruning only see ``step-<N>``), every rank loads that with ``checkpoint.load_universal``
set, and rank 0 removes it. DeepSpeed reads that setting only while loading, so it is on
just for that load; a checkpoint of the same world size loads as saved. ZeRO-0 is refused
at another world size (:meth:`DeepSpeedEngine.refusal`): in fp32 its optimizer is not
ZeRO's, leaving no partition files to convert, and its bf16 optimizer's universal path is
untested.

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

import argparse
import contextlib
import io
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from proto.job import TrainSection
from ringmaster.rank import durable
from ringmaster.rank.file_transfer import share_from_rank0
from ringmaster.rank.host_buffers import HostBuffers
from trainer.model import lm_loss
from trainer.precision import Precision

TAG = "ds"  # the one checkpoint tag inside every step dir
UNIVERSAL = "ds-universal"  # beside the step dirs: the converted copy a resharded load reads


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
        checkpoint_group: object,
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
        self.checkpoint_group = checkpoint_group  # gloo: files travel over it
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
        if manifest.world_size == self.world_size or self.zero_stage > 0:
            return None
        return f"ZeRO-0 loads only at the world size that wrote it ({manifest.world_size})"

    def files_for(self, manifest: durable.Manifest) -> list[str] | None:
        if self.refusal(manifest) is not None:
            return None
        if manifest.world_size == self.world_size:
            own = manifest.ranks.get(str(self.rank), [])
            return [name for name in own if name.startswith(f"{TAG}/")]
        # at another world size rank 0 converts every saved rank's files; the others read
        # only its converted copy
        return (
            sorted(n for n in manifest.files if n.startswith(f"{TAG}/")) if self.rank == 0 else []
        )

    def memory_files(self, manifest: durable.Manifest, rank: int) -> list[str] | None:
        """At the world size that wrote it: its own files and rank 0's (the model states
        every rank loads under ZeRO-1/2). At another: every file for rank 0, which
        converts them (:meth:`_load_universal`), and none for the others."""
        if self.refusal(manifest) is not None:
            return None
        if manifest.world_size == self.world_size:
            names = {*manifest.ranks.get(str(rank), []), *manifest.ranks.get("0", [])}
        else:
            names = set(manifest.files) if rank == 0 else set()
        return sorted(name for name in names if name.startswith(f"{TAG}/"))

    def load(self, step_dir: Path, manifest: durable.Manifest) -> None:
        if manifest.world_size == self.world_size:
            path, _ = self.ds.load_checkpoint(str(step_dir), tag=TAG)
        else:
            path = self._load_universal(step_dir)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {step_dir}")

    def _load_universal(self, step_dir: Path) -> str | None:
        """Load ``step_dir`` (another world size's) through a universal copy of it, on
        every rank; the copy lives only for this load."""
        universal = step_dir.parent / UNIVERSAL
        failure = None
        if self.rank == 0:
            shutil.rmtree(universal, ignore_errors=True)  # a killed attempt's
            try:
                to_universal(step_dir / TAG, universal / TAG)
            except Exception as exc:  # reaches every rank below, not just this one
                failure = f"converting {step_dir} to a universal checkpoint failed: {exc!r}"
        box = [failure]
        dist.broadcast_object_list(box, src=0)  # and the other ranks wait for the copy
        if box[0] is not None:
            raise RuntimeError(box[0])
        # a restore from the memory tier is in each rank's own dir: rank 0 sends its copy
        share_from_rank0(universal, self.rank, self.world_size, self.checkpoint_group)
        self.ds._config.load_universal_checkpoint = True  # ``checkpoint.load_universal``
        try:
            path: str | None
            path, _ = self.ds.load_checkpoint(str(universal), tag=TAG)
            dist.barrier()  # every rank has read the copy
        finally:
            self.ds._config.load_universal_checkpoint = False
            if self.rank == 0:
                shutil.rmtree(universal, ignore_errors=True)
        return path

    def close(self) -> None:
        self.buffers.wait()
        self.buffers = HostBuffers()  # drop the host copies of the last checkpoint


def to_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of the tag dir ``checkpoint`` into ``out`` (it also
    writes ``latest_universal`` beside ``out``), in this process and quietly: one worker,
    as forking a rank that holds process groups and their threads is not safe; the
    universal-checkpoint info it requires is injected (only tensor- or pipeline-parallel
    models need more than its version)."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(checkpoint),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    chatter = io.StringIO()  # its progress prints and bars
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        ds_to_universal.main(args)
