"""Training engines: what turns a batch into an optimizer step, and what a rank's
checkpoint shard holds.

The worker loop only sees the :class:`Engine` protocol, so DeepSpeed (ZeRO) slots in next to
plain DDP: it differs in how gradients are reduced, where optimizer state lives and which
shard a rank needs on resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from proto.job import TrainSection
from ringmaster.rank.dcp_async import DcpCheckpoints, DcpState
from ringmaster.rank.state import State
from trainer.model import lm_loss
from trainer.precision import Precision, autocast_context


class Engine(State, Protocol):
    """A training engine: what turns a batch into an optimizer step, and (as a
    :class:`ringmaster.rank.state.State`, the rank runtime's checkpoint format hooks)
    what a rank's checkpoint shard holds."""

    module: nn.Module  # the unwrapped model

    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | float | None]:
        """One optimizer step; returns this rank's loss (a detached scalar tensor: the loop
        averages it over the ranks in the all-reduce that also carries the control word)
        and the global gradient norm before clipping (the same on every rank; None if the
        engine cannot tell), which :mod:`trainer.numeric` judges."""
        ...


class TorchEngine(DcpCheckpoints):
    """What the DDP and FSDP engines share: AdamW over the unwrapped ``module``'s
    parameters, forward through the ``wrapped`` one, gradients clipped by global norm, DCP
    checkpoints (:class:`ringmaster.rank.dcp_async.DcpState`). Built after the wrapping, so the
    optimizer sees the parameters as the wrapper left them (FSDP2: DTensor shards)."""

    def __init__(
        self,
        module: nn.Module,
        wrapped: nn.Module,
        train: TrainSection,
        autocast: Callable[[], contextlib.AbstractContextManager[object]],
        device: torch.device,
        checkpoint_group: dist.ProcessGroup | None,
        replicated: bool,
    ) -> None:
        self.module = module
        self.wrapped = wrapped
        self.device = device
        self.grad_clip = train.grad_clip
        self.autocast = autocast
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=train.lr)
        self.state = DcpState(module, self.optimizer, checkpoint_group, replicated)

    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | float | None]:
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            logits = self.wrapped(inputs.to(self.device))
        loss = lm_loss(logits, targets.to(self.device))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        if isinstance(norm, DTensor):  # FSDP2: the norm of sharded gradients, reduced
            norm = norm.full_tensor()
        self.optimizer.step()
        self.after_optimizer_step()
        return loss.detach(), norm.detach()

    def after_optimizer_step(self) -> None:
        """What an engine does once the weights have changed (nothing, by default)."""


class DDPEngine(TorchEngine):
    """DistributedDataParallel. Parameters and optimizer state are replicated: each rank
    stages and writes only its share of them (:func:`ringmaster.rank.dcp_async.replicated_share`),
    and a job resumed with another world size loads the same state. ``share=False`` (a
    benchmark's baseline only) has every rank stage all of it."""

    name = "ddp"

    def __init__(
        self,
        module: nn.Module,
        train: TrainSection,
        precision: Precision,
        device: torch.device,
        checkpoint_group: dist.ProcessGroup | None = None,
        share: bool = True,
    ) -> None:
        module = module.to(device)
        ddp = DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None
        )
        autocast = autocast_context(precision, device)
        super().__init__(module, ddp, train, autocast, device, checkpoint_group, replicated=share)
