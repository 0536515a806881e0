"""Per-step instruments on the model itself: this rank's compute time, rank 0's window over
every rank's, and the rehearsal faults of a simulated node.

**Compute time.** A straggler is judged by its own work, so the figure must not include
waiting for peers (or one slow rank would make every rank look slow). It runs from the
start of the engine's step to the moment backward has carried the gradient back to the
token embedding's output (a hook on that tensor): the forward, the loss and the backward
through the head and every block, i.e. all of the step's FLOPs but the embedding's own
backward and the optimizer's. DDP and DeepSpeed ZeRO-1/2 only *start* gradient reductions
inside that window (DDP asynchronously per bucket, DeepSpeed at the end of backward) and
wait for them after it, so a slow peer does not show in it. FSDP and ZeRO-3 all-gather
parameters inside it, so with them a peer's delay leaks into every rank's figure and the
ratios between ranks understate a straggler. On CUDA the window is timed with CUDA events,
read after the step's kernels are queued (no synchronisation inside the step).

The ranks' figures travel in the step's loss all-reduce (:meth:`ringmaster.rank.control.StepControl.
reduce_step`), one slot per rank, so gathering them costs no collective; rank 0 keeps the
window (:class:`StragglerWindow`) and reports medians, and the coordinator decides.

**Rehearsal faults** (:mod:`trainer.sim_knobs`, simulated nodes only): ``slow=F`` sleeps
(F−1) × the window's time at its end, inside it, so the rank computes F times slower and
its peers wait for it in the gradient reduction as they would for a slow GPU.
``nan_loss`` turns the head's logits non-finite for one step, before the loss and its
backward, so the all-reduced loss is non-finite on every rank.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from proto.progress import Stragglers
from trainer.sim_knobs import SimKnobsReader


class StepProbe:
    def __init__(
        self, module: nn.Module, device: torch.device, knobs: SimKnobsReader | None = None
    ) -> None:
        self.knobs = knobs
        self.cuda = device.type == "cuda"
        self._events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if self.cuda
            else None
        )
        self._armed = False  # the next embedding forward of this step hooks its output
        self._poison = False
        self._start = 0.0
        self._seconds: float | None = None
        module.get_submodule("tok_emb").register_forward_hook(self._on_embedding)
        if knobs is not None:
            module.get_submodule("head").register_forward_hook(self._on_head)

    def begin(self) -> bool:
        """Right before the engine's step. True when this step's loss is to be poisoned."""
        self._poison = False
        if self.knobs is not None:
            self.knobs.poll()
            self._poison = self.knobs.take_nan()
        self._seconds = None
        self._armed = True
        self._start = time.perf_counter()
        if self._events is not None:
            self._events[0].record()
        return self._poison

    def end(self, fallback_s: float) -> float:
        """This rank's compute seconds in the step just taken; ``fallback_s`` (the whole
        step) if the gradient never reached the embedding."""
        self._armed = self._poison = False
        if self._seconds is None:
            return fallback_s
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._seconds

    def _on_embedding(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self._armed and torch.is_grad_enabled() and output.requires_grad:
            self._armed = False
            output.register_hook(self._on_gradient)

    def _on_gradient(self, grad: torch.Tensor) -> None:
        slow = self.knobs.slow if self.knobs is not None else 1.0
        if slow > 1.0:
            if self.cuda:
                torch.cuda.synchronize()
            time.sleep((slow - 1.0) * (time.perf_counter() - self._start))
        self._seconds = time.perf_counter() - self._start
        if self._events is not None:
            self._events[1].record()

    def _on_head(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * float("nan") if self._poison else None


class StragglerWindow:
    """Rank 0: every rank's compute seconds over ``window_steps`` steps, reported as one
    :class:`proto.progress.Stragglers` of medians per window (a median, so one step's
    hiccup does not make a straggler)."""

    def __init__(self, window_steps: int) -> None:
        self.window_steps = window_steps
        self.samples: list[list[float]] = []

    def add(self, step: int, rank_s: list[float]) -> Stragglers | None:
        """Record one step's figures; the report once the window is full."""
        self.samples.append(rank_s)
        if len(self.samples) < self.window_steps:
            return None
        by_rank = [statistics.median(column) for column in zip(*self.samples, strict=True)]
        self.samples = []
        return Stragglers(step=step, rank_step_s=by_rank, window_steps=self.window_steps)
