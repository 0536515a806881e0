"""Every Ringmaster reaction in an accelerate training loop, in a few lines the loop adds::

    from ringmaster.integrations.accelerate import Ringmaster

    accelerator = Accelerator()
    ringmaster = Ringmaster(accelerator, output_dir)
    model, optimizer, loader, scheduler = accelerator.prepare(...)
    step = ...  # the script's own resume: load_state of its newest checkpoint-<step>
    step = ringmaster.restore(step)   # the memory tier, when it holds a newer step
    for batch in ...:
        ...                           # forward, accelerator.backward, optimizer.step
        step += 1
        ringmaster.step(step, loss)   # sets accelerate's trigger on a stop
        if accelerator.check_trigger():
            break
    ringmaster.finish()

(A loop that checks no trigger adds ``if accelerator.check_trigger(): break``, or leaves
when :meth:`Ringmaster.step` returns True.)

What it maps, each onto accelerate's own way:

- **checkpoint** (an operator's, a preemption notice's, a stop's): at the step every rank
  agrees on, :meth:`Ringmaster.step` has every rank call ``accelerator.save_state`` (it is
  collective) into ``output_dir/checkpoint-<step>``, the checkpoint the script's own
  ``load_state`` resumes from after a restart, and reports it once every rank has written
  its part. The script's own ``save_state`` calls are reported too (a
  ``register_save_state_pre_hook``; the step is the ``N`` of ``checkpoint-N`` or
  ``step_N``, else the step that follows the save).
- **stop**: ``accelerator.set_trigger()`` after that save, so the loop's
  ``accelerator.check_trigger()`` leaves it on every rank alike (accelerate's own way to
  stop early); :meth:`Ringmaster.step` returns it too, for a loop that checks no trigger.
- **pause**: inside :meth:`Ringmaster.step`, every rank at the same step, no rank in a
  collective.
- **memory tier**: what ``save_state`` saves is registered with the rank API — the prepared
  model and optimizer (through ``torch.distributed.checkpoint``), further models and
  optimizers, the schedulers, the gradient scaler, stateful data loaders, the objects of
  ``register_for_checkpointing``, the accelerator's step counter, and the RNGs. After a
  fault, :meth:`Ringmaster.restore` loads a snapshot newer than the script's own checkpoint
  in place and returns its step; the loop positions its data from that step as it does
  after ``load_state`` (``skip_first_batches``).
- **phases**: :func:`phase` (also ``Ringmaster.phase``; a context manager, or a decorator
  of the evaluation function) names evaluation; the script's own ``save_state`` is the
  phase ``save`` until the next step. Neither is judged as a hang nor counted as training.

Approximate: the data position is the loop's own, derived from the step (the batches of an
epoch are the same after a restart only with a seeded sampler, accelerate's
``use_seedable_sampler``); the loss reported is rank 0's own; a model under DeepSpeed or
Megatron-LM is not registered, so those loops get pause, checkpoint and stop but no memory
tier. ``save_state`` must be called on every rank, as accelerate requires: its report waits
for all of them.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ringmaster import rank

FRAMEWORK = "accelerate"
# a checkpoint directory named by its step: this helper's, and accelerate's examples'
NAMED_BY_STEP = re.compile(r"(?:checkpoint-|step_)(\d+)")


def _open() -> None:
    rank.init(FRAMEWORK, loop_saves=True)


@contextlib.contextmanager
def phase(name: str, bound_s: float | None = None) -> Iterator[None]:
    """A stretch without steps (``"eval"`` …) under its own name and bound (None: the
    job's hang threshold): :func:`ringmaster.rank.phase`, usable as a decorator too
    (``@phase("eval")`` on the evaluation function)."""
    _open()
    with rank.phase(name, bound_s):
        yield


class _AcceleratorProgress:
    """The accelerator's own counters (what ``save_state`` keeps of it), as a registered
    object: restored with a snapshot."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        a = self.accelerator
        return {"step": a.step, "iteration": a.project_configuration.iteration}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.accelerator.step = saved["step"]
        self.accelerator.project_configuration.iteration = saved["iteration"]


class Ringmaster:
    """Ringmaster's reactions in one accelerate loop, on every rank: build it right after
    the ``Accelerator`` (``output_dir``: where the script's ``checkpoint-<step>``
    directories are)."""

    def __init__(self, accelerator: Accelerator, output_dir: str | Path) -> None:
        _open()
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self._phases = contextlib.ExitStack()  # the script's own save, until the next step
        self._own_saves: list[tuple[Path, float]] = []  # not reported yet: path, began
        self._saving = False  # this helper's own save_state is running
        self._reported: int | None = None  # the step of the last own save reported
        self._step = 0
        accelerator.register_save_state_pre_hook(self._saving_state)

    phase = staticmethod(phase)

    def restore(self, resumed: int) -> int:
        """Call once, after ``accelerator.prepare`` and the script's own resume:
        ``resumed`` is the step the script loaded with ``load_state`` (0: none). Registers
        what ``save_state`` saves and, when the memory tier holds a newer step that every
        rank can load, loads it in place. Returns the step to continue after (``resumed``
        outside a Ringmaster job); position the data from it as after ``load_state``."""
        if rank.in_job():
            model, optimizer, objects = _prepared(self.accelerator)
            rank.register(model, optimizer, **objects)
        self._step = rank.restore(loop_step=resumed)
        return self._step

    def step(
        self,
        step: int,
        loss: float | torch.Tensor | None = None,
        *,
        tokens: int | None = None,
        target: int | None = None,
    ) -> bool:
        """The boundary after optimizer step ``step``, on every rank: reports progress
        (``loss``, ``tokens`` this step over all ranks, the ``target`` step), pauses here
        while paused, writes the checkpoint Ringmaster asks for, and on a stop sets
        accelerate's trigger. Returns whether to leave the loop. Between the optimizer
        steps of gradient accumulation (``accelerator.sync_gradients`` false) it returns
        at once."""
        if not self.accelerator.sync_gradients:
            return False
        self._report_own_saves(step)
        decision = rank.step(step, loss=loss, tokens=tokens, target=target)
        self._step = step
        if decision.save and self._reported != step:  # not the script's own save again
            self._save(step)
        if decision.stop:
            self.accelerator.set_trigger()
        return decision.stop

    def finish(self) -> None:
        """Training ended, on every rank (after the loop, a stop's included)."""
        self._report_own_saves(self._step)
        rank.finish()

    # -- saves ------------------------------------------------------------------------------

    def _save(self, step: int) -> None:
        path = self.output_dir / f"checkpoint-{step}"
        began = time.perf_counter()
        self._saving = True
        try:
            with rank.phase(rank.SAVING):
                self.accelerator.save_state(str(path))
        finally:
            self._saving = False
        rank.saved(step, path, stall_s=time.perf_counter() - began)

    def _saving_state(self, models: Any, weights: Any, output_dir: str) -> None:
        """accelerate's pre-hook of every ``save_state``: the script's own is reported at
        the next step (its files are written by then) and is the phase ``save`` until it."""
        if self._saving:
            return
        if not self._own_saves:
            self._phases.enter_context(rank.phase(rank.SAVING))
        self._own_saves.append((Path(output_dir), time.perf_counter()))

    def _report_own_saves(self, step: int) -> None:
        """Report the script's own saves since the last step (every rank called
        ``save_state``, so every rank reports them alike): ``step``, unless the directory
        says its step."""
        self._phases.close()
        for path, began in self._own_saves:
            named = NAMED_BY_STEP.fullmatch(path.name)
            saved = int(named.group(1)) if named else step
            rank.saved(saved, path, stall_s=time.perf_counter() - began)
            self._reported = saved
        self._own_saves.clear()


def _prepared(
    accelerator: Accelerator,
) -> tuple[torch.nn.Module | None, torch.optim.Optimizer | None, dict[str, Any]]:
    """What ``accelerator.save_state`` saves: its first model and optimizer (the torch
    optimizer inside accelerate's wrapper) for ``torch.distributed.checkpoint``, the rest
    by name."""
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        return None, None, {}  # their engines save themselves: no memory tier
    try:
        models = list(accelerator._models)
        optimizers = list(accelerator._optimizers)
        schedulers = list(accelerator._schedulers)
        loaders = list(accelerator._dataloaders)
        custom = list(accelerator._custom_objects)
    except AttributeError as exc:  # accelerate's lists of prepared objects moved
        raise rank.RankApiError(
            f"ringmaster.integrations.accelerate: this accelerate keeps no {exc.name}; "
            "it supports the accelerate its extra installs"
        ) from None
    if not models:
        raise rank.RankApiError(
            "Ringmaster.restore() before accelerator.prepare(model, ...): prepare the "
            "training objects first, load the script's own checkpoint, then restore"
        )
    model = models.pop(0)
    optimizer = optimizers.pop(0) if optimizers else None
    objects: dict[str, Any] = {"accelerator": _AcceleratorProgress(accelerator)}
    objects |= {f"model_{i + 1}": m for i, m in enumerate(models)}
    objects |= {f"optimizer_{i + 1}": o for i, o in enumerate(optimizers)}
    objects |= {f"scheduler_{i}": s for i, s in enumerate(schedulers)}
    objects |= {f"custom_{i}": o for i, o in enumerate(custom)}
    objects |= {
        f"dataloader_{i}": d
        for i, d in enumerate(loaders)
        if getattr(d, "use_stateful_dataloader", False)
    }
    if accelerator.scaler is not None:
        objects["scaler"] = accelerator.scaler
    return model, getattr(optimizer, "optimizer", optimizer), objects
