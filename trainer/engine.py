"""Training engines: what turns a batch into an optimizer step, and what a rank's
checkpoint shard holds.

The worker loop only sees the :class:`Engine` protocol, so DeepSpeed (ZeRO) slots in next to
plain DDP: it differs in how gradients are reduced, where optimizer state lives and which
shard a rank needs on resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from proto.job import TrainSection
from trainer import durable
from trainer.checkpoint import HostBuffers, load_file
from trainer.model import lm_loss
from trainer.precision import Precision, autocast_context


class Engine(Protocol):
    name: str
    module: nn.Module  # the unwrapped model

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step; returns the loss averaged over all ranks."""
        ...

    def snapshot(self, directory: Path) -> dict[str, Any]:
        """Copy this rank's model and optimizer state for a checkpoint, quickly (the loop
        waits): file name -> an in-memory copy the next step cannot change, serialised later
        by the persist thread. An engine that cannot hand over its state that way may write
        files into ``directory`` (the rank's empty staging dir) instead."""
        ...

    def files_for(self, manifest: durable.Manifest) -> list[str] | None:
        """The files of a checkpoint this rank verifies and loads; None if it cannot use
        that checkpoint (another engine, or a layout this world size cannot load)."""
        ...

    def load(self, step_dir: Path, manifest: durable.Manifest) -> None:
        """Restore the state :meth:`snapshot` captured, from a verified checkpoint."""
        ...


class DDPEngine:
    """DistributedDataParallel + AdamW, gradients clipped by global norm.

    Parameters and optimizer state are replicated, so each rank's ``rank-<r>.pt`` is a full
    copy: a job resumed with a different world size loads rank 0's.
    """

    name = "ddp"

    def __init__(
        self,
        module: nn.Module,
        train: TrainSection,
        precision: Precision,
        device: torch.device,
        rank: int,
        world_size: int,
    ) -> None:
        self.module = module.to(device)
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.grad_clip = train.grad_clip
        self.ddp = DistributedDataParallel(
            self.module, device_ids=[device.index] if device.type == "cuda" else None
        )
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=train.lr)
        self.autocast = autocast_context(precision, device)
        self.buffers = HostBuffers()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            logits = self.ddp(inputs.to(self.device))
        loss = lm_loss(logits, targets.to(self.device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        self.optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        return mean.item() / self.world_size

    def snapshot(self, directory: Path) -> dict[str, Any]:
        state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        name = durable.shard_name(self.rank)
        return {name: self.buffers.copy(state, name)}

    def files_for(self, manifest: durable.Manifest) -> list[str] | None:
        if manifest.engine != self.name:
            return None
        rank = self.rank if manifest.world_size == self.world_size else 0
        return [durable.shard_name(rank)]

    def load(self, step_dir: Path, manifest: durable.Manifest) -> None:
        files = self.files_for(manifest)
        assert files is not None
        state = load_file(step_dir / files[0])
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
