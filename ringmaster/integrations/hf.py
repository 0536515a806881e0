"""Every Ringmaster reaction in a Hugging Face ``Trainer``: add the callback, nothing else::

    from ringmaster.integrations.hf import RingmasterCallback
    trainer = Trainer(..., callbacks=[RingmasterCallback()])

What it maps, each onto the ``Trainer``'s own way:

- **checkpoint** (an operator's, a preemption notice's, a stop's): ``control.should_save``
  at the step every rank agrees on, so the ``Trainer`` writes its own ``checkpoint-N``,
  which the script's own ``resume_from_checkpoint`` loads after a restart; ``on_save``
  reports it (once every rank has written its part).
- **stop**: ``control.should_training_stop`` after that save.
- **pause**: inside ``on_step_end``, every rank at the same step, no rank in a collective.
- **memory tier**: the model, optimizer, scheduler, RNGs and the ``Trainer``'s step are
  registered with the rank API; after a fault, a snapshot newer than the ``Trainer``'s own
  checkpoint is loaded in place at ``on_train_begin``, and the data loader skips to it.
- **phases**: evaluation and the ``Trainer``'s own saving are named phases, so neither is
  judged as a hang nor counted as training.

Where the ``Trainer`` has already fast-forwarded its data loader into the middle of an
epoch (it resumed from its own checkpoint there) the loader cannot skip further; the
snapshot's weights are still loaded, and the rank log says how many batches repeat.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ringmaster import rank


class _TrainerProgress:
    """The ``Trainer``'s own counters, as a registered object: restored with a snapshot."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        return {
            "global_step": s.global_step,
            "epoch": s.epoch,
            "total_flos": s.total_flos,
            "num_input_tokens_seen": s.num_input_tokens_seen,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for key, value in saved.items():
            setattr(self.state, key, value)


class RingmasterCallback(TrainerCallback):
    def __init__(self) -> None:
        rank.init("hf", loop_saves=True)
        self._phases = contextlib.ExitStack()
        self._step_ended = 0.0
        self._tokens_seen = 0
        self._skipping: Any = None  # the loader told to skip to a snapshot's step

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        resumed = state.global_step  # the Trainer's own checkpoint, if it loaded one
        rank.register(
            kwargs["model"],
            kwargs["optimizer"],
            scheduler=kwargs["lr_scheduler"],
            trainer=_TrainerProgress(state),
        )
        step = rank.restore(loop_step=resumed)
        loader = kwargs.get("train_dataloader")
        if step > resumed and _skip_to(loader, resumed, step, args.gradient_accumulation_steps):
            self._skipping = loader
        self._tokens_seen = state.num_input_tokens_seen
        self._step_ended = time.perf_counter()

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        seen = state.num_input_tokens_seen
        tokens = (seen - self._tokens_seen) or None
        self._tokens_seen = seen
        decision = rank.step(
            state.global_step, loss=_last_loss(state), tokens=tokens, target=state.max_steps
        )
        if decision.save:
            control.should_save = True
        if decision.stop:
            control.should_training_stop = True
        self._step_ended = time.perf_counter()
        if control.should_evaluate:
            self._phases.enter_context(rank.phase("eval"))
        elif control.should_save:
            self._phases.enter_context(rank.phase(rank.SAVING))

    def on_epoch_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self._skipping is not None:  # only the resumed epoch starts part-way
            self._skipping.skip_batches = 0
            self._skipping = None

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._phases.close()
        if control.should_save:  # the Trainer saves right after evaluating
            self._phases.enter_context(rank.phase(rank.SAVING))

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._phases.close()
        path = Path(args.output_dir or ".") / f"checkpoint-{state.global_step}"
        rank.saved(state.global_step, path, stall_s=time.perf_counter() - self._step_ended)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._phases.close()
        rank.finish()


def _last_loss(state: TrainerState) -> float | None:
    for entry in reversed(state.log_history):
        if "loss" in entry:
            return float(entry["loss"])
    return None


def _skip_to(loader: Any, resumed: int, step: int, accumulation: int) -> bool:
    """Make the data loader start at ``step``'s batch, where the ``Trainer`` positioned it
    for ``resumed``: possible when it did not fast-forward into an epoch itself (it starts
    at the epoch's first batch) and ``step`` is in that same epoch. Whether it could."""
    per_epoch = len(loader) // max(1, accumulation) if hasattr(loader, "__len__") else 0
    fits = per_epoch > 0 and resumed % per_epoch == 0 and step // per_epoch == resumed // per_epoch
    if fits and hasattr(loader, "skip_batches"):
        loader.skip_batches = (step % per_epoch) * accumulation
        return True
    print(
        f"ringmaster: the Trainer positioned its data loader for step {resumed}; the batches "
        f"of steps {resumed + 1}-{step} are trained on again after the memory tier's step {step}",
        flush=True,
    )
    return False
