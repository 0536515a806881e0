"""Training engines: what turns a batch into an optimizer step, and what a rank's
checkpoint shard holds.

The worker loop only sees the :class:`Engine` protocol, so DeepSpeed (ZeRO) slots in next to
plain DDP: it differs in how gradients are reduced, where optimizer state lives and which
shard a rank needs on resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from proto.job import TrainSection
from trainer import durable
from trainer.dcp_async import DcpCheckpoints, DcpState
from trainer.model import lm_loss
from trainer.precision import Precision, autocast_context


class State(Protocol):
    """What a checkpoint holds of a rank and how it comes back: the checkpoint half of an
    :class:`Engine`, and what a loop registers through the rank API
    (:class:`ringmaster.rank.state.Registered`). The checkpointer, the memory tier and the
    resume (:mod:`ringmaster.rank.session`) see only this."""

    name: str  # recorded in the manifest: a checkpoint loads only into a state of its name

    def snapshot(self, staging: Path, target: Path) -> dict[str, Any]:
        """Copy this rank's state for a checkpoint of step dir ``target``, quickly (the
        loop waits): file name -> an in-memory copy the next step cannot change, serialised
        later by the persist thread, or a :class:`trainer.checkpoint.Written` for files the
        state writes into ``target`` in the background. A state that cannot hand itself
        over either way may write files into ``staging`` (the rank's empty staging dir)."""
        ...

    def prepare_snapshot(self) -> None:
        """Start allocating the host buffers :meth:`snapshot` copies into, in the
        background (the first snapshot waits for that if still needed). Called on every
        rank at the same point, after the first optimizer step of the process, when the
        optimizer state exists; may take collectives."""
        ...

    def files_for(self, manifest: durable.Manifest) -> list[str] | None:
        """The files of a checkpoint this rank verifies and loads; None if it cannot use
        that checkpoint (another state's, or a layout this world size cannot load). A
        checkpoint written at another world size loads where the state reshards it."""
        ...

    def refusal(self, manifest: durable.Manifest) -> str | None:
        """Why :meth:`files_for` refuses ``manifest``, in a few words for the operator's
        one line; None when it does not (the files may still fail their checksums)."""
        ...

    def memory_files(self, manifest: durable.Manifest, rank: int) -> list[str] | None:
        """Every file rank ``rank`` of this world opens loading ``manifest``: its own and
        the other ranks' it reads too (at another world size, what resharding reads).
        A durable dir shows every rank every file; the memory tier brings these to the
        rank's node. None where :meth:`files_for` refuses the checkpoint."""
        ...

    def load(self, step_dir: Path, manifest: durable.Manifest) -> None:
        """Restore the state :meth:`snapshot` captured, from a verified checkpoint."""
        ...

    def close(self) -> None:
        """Release what checkpoints hold (host buffers), after the last one is durable."""
        ...


class Engine(State, Protocol):
    """A training engine: what turns a batch into an optimizer step, and (as a
    :class:`State`) what a rank's checkpoint shard holds."""

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
    checkpoints (:class:`trainer.dcp_async.DcpState`). Built after the wrapping, so the
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
    stages and writes only its share of them (:func:`trainer.dcp_async.replicated_share`),
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
