"""Every Ringmaster reaction in a PyTorch Lightning ``Trainer``: add the callback, nothing
else::

    from ringmaster.integrations.lightning import RingmasterCallback
    trainer = Trainer(..., callbacks=[ModelCheckpoint(..., save_last=True), RingmasterCallback()])
    trainer.fit(model, ckpt_path="last")

What it maps, each onto Lightning's own way:

- **checkpoint** (an operator's, a preemption notice's, a stop's): Lightning's own
  checkpoint, written at the step every rank agrees on by the ``ModelCheckpoint`` that keeps
  ``last.ckpt`` (``save_last=True``), so ``trainer.fit(..., ckpt_path="last")`` resumes from
  it after a restart. Without ``save_last=True``, ``trainer.save_checkpoint`` writes
  ``last.ckpt`` in the first ``ModelCheckpoint``'s directory, where ``ckpt_path="last"``
  finds it too (with no ``ModelCheckpoint`` at all: in ``default_root_dir/checkpoints``,
  which the script must then name). Every rank writes it (Lightning's save is collective)
  and reports it. Lightning's own saves (``every_n_train_steps`` …) are reported as the
  job's checkpoints too, at the hook after they are written.
- **stop**: ``trainer.should_stop`` after that save (Lightning honours it once its
  ``min_steps``/``min_epochs`` are met).
- **pause**: inside ``on_train_batch_end``, every rank at the same optimizer step, no rank
  in a collective.
- **memory tier**: the ``LightningModule``, the optimizer (more than one: the first through
  DCP, the others whole in each rank's own file), the LR schedulers, the precision plugin's
  state, the RNGs and Lightning's loop progress (its global step, epoch and batch counters:
  the ``fit_loop`` state a Lightning checkpoint holds) are registered with the rank API.
  After a fault, a snapshot newer than the checkpoint Lightning resumed from is loaded in
  place at ``on_train_start``, and the loop's counters are put back the way Lightning's own
  resume does, so ``trainer.global_step`` is the snapshot's step.
- **phases**: validation (sanity check included) and Lightning's own saving are named
  phases (``eval``, ``save``), so neither is judged as a hang nor counted as training.
- **SIGTERM**: Lightning installs its own handler when ``fit`` starts (calling ours after
  its own). At ``on_train_start`` Ringmaster's is put first again; Lightning's notifier,
  which broadcasts from inside the signal handler and can hang against a peer's collective,
  is called instead at the next step boundary every rank agrees on, on every rank: after
  the notice's checkpoint, Lightning sees ``trainer.received_sigterm`` and leaves by its own
  ``SIGTERMException``, and the rank exits as a notice says.

The data position after a memory-tier restore is what Lightning's own resume from a
mid-epoch checkpoint gives: the epoch and batch counters are the snapshot's, but a plain
``DataLoader`` cannot be positioned mid-epoch, so the epoch's loader starts again from its
first batch (the sampler's order for that epoch) and the epoch ends when its batch count is
reached: the batches of its first steps are trained on again, and as many at its end are
not seen in that epoch; Lightning warns about it ("dataloader is not resumable"). A loader
with ``state_dict`` that Lightning restored from its own checkpoint stays where that
checkpoint left it: the batches between it and the snapshot are trained on again.
Callbacks' own state (``EarlyStopping`` …) is the one Lightning resumed, not the snapshot's.

Written against pytorch-lightning 2.6: a few of ``ModelCheckpoint``'s and the loops'
internals are used (named where they are).
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities.exceptions import SIGTERMException

from ringmaster import rank
from ringmaster.rank import termination

LAST = "last.ckpt"  # what ``ckpt_path="last"`` looks for: ``last*.ckpt`` in a ModelCheckpoint's dir


class _LoopProgress:
    """Lightning's loop counters (global step, epoch, batch within it, the validation
    loop's), as a registered object: what a Lightning checkpoint holds as ``loops.fit_loop``,
    loaded back the way Lightning's own resume loads it."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.fit_loop.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        fit_loop = self.trainer.fit_loop
        # Lightning's resume: ``restore_loops`` loads the counters (and marks the loops as
        # restarting), then ``FitLoop.run`` resets on them and ``on_run_start`` settles the
        # epoch; at ``on_train_start`` the loop has done those two already, so again here
        fit_loop.load_state_dict(saved)
        fit_loop.reset()
        if not fit_loop._iteration_based_training():
            current = fit_loop.epoch_progress.current  # a _ProcessedTracker, typed as less
            current.completed = current.processed  # type: ignore[attr-defined]


class RingmasterCallback(pl.Callback):
    def __init__(self) -> None:
        self._ours: Any = None  # Ringmaster's SIGTERM handler, in a job
        self._in_job = rank.init("lightning", loop_saves=True)  # outside one: does nothing
        if self._in_job:
            termination.install()  # ours already (the API took SIGTERM); re-taken if not
            self._ours = signal.getsignal(signal.SIGTERM)
        self._phases = contextlib.ExitStack()
        self._phase: str | None = None  # the phase entered, if any
        self._phase_began = 0.0
        self._started = False  # restored: the rank API's loop is open
        self._step = 0  # the last optimizer step reported
        self._target: int | None = None
        self._losses: list[torch.Tensor] = []  # the batches' losses since the last step
        self._saved_step = -1  # the step of the last checkpoint reported
        self._pending: int | None = None  # a step Lightning began saving, not yet reported
        self._notifier: Any = None  # Lightning's SIGTERM notifier, called at the boundary

    # -- the start: state registered, the memory tier restored, SIGTERM ---------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._in_job:
            return
        self._sigterm_first(trainer)
        resumed = trainer.global_step  # the checkpoint Lightning loaded (ckpt_path), if any
        optimizers = list(trainer.optimizers)
        objects: dict[str, Any] = {
            "lightning": _LoopProgress(trainer),
            "precision": trainer.precision_plugin,
        }
        for i, config in enumerate(trainer.lr_scheduler_configs):
            objects["scheduler" if i == 0 else f"scheduler_{i}"] = config.scheduler
        for i, optimizer in enumerate(optimizers[1:], start=1):
            objects[f"optimizer_{i}"] = optimizer  # DCP takes one optimizer: these whole
        rank.register(pl_module, optimizers[0] if optimizers else None, **objects)
        self._step = rank.restore(loop_step=resumed)  # the snapshot's loaded, when newer
        self._started = True
        self._saved_step = resumed
        target = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        self._target = int(target) if math.isfinite(target) and target > 0 else None

    def _sigterm_first(self, trainer: pl.Trainer) -> None:
        """SIGTERM to Ringmaster's handler, and to Lightning's at the step every rank agrees
        on. Lightning's ``_SignalConnector`` installed its handler when ``fit`` began (after
        ours, at ``__init__``), a list it calls in turn: its notifier, then the handler it
        found (ours). The notifier sets ``trainer.received_sigterm`` and broadcasts it on the
        default group from inside the handler — on a rank that a peer's collective (DDP's
        gradient all-reduce) is waiting for, the two never match and both hang. So ours runs
        alone at the signal (the agent's stop exits at once; a notice is flagged for the
        next boundary, which every rank then reaches), and Lightning's notifier is called
        at that boundary by every rank (:meth:`on_train_batch_end`), where its broadcast
        matches; anything else in Lightning's list is still called at the signal, after
        ours. ``termination.install()`` re-takes SIGTERM and chains to what it finds, so
        ours and the notifier are taken out of Lightning's list first (else ours and the
        list would call each other for ever); a handler that replaced ours is chained to as
        it is. Lightning puts ours back, alone, when ``fit`` ends."""
        current = signal.getsignal(signal.SIGTERM)
        if current is self._ours:
            return
        # pytorch-lightning internals (2.6): _HandlersCompose.signal_handlers and the notifier
        handlers = getattr(current, "signal_handlers", None)
        notifier = getattr(
            getattr(trainer, "_signal_connector", None), "_sigterm_notifier_fn", None
        )
        if isinstance(handlers, list):
            if notifier is not None and notifier in handlers:
                self._notifier = notifier
            handlers[:] = [h for h in handlers if h is not self._ours and h != notifier]
        termination.install()

    # -- the step boundary ------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._report_pending(trainer)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._started:  # outside a job
            return
        loss = _loss(outputs)
        if loss is not None:
            self._losses.append(loss)
        step = trainer.global_step
        if step <= self._step:  # accumulating gradients: no optimizer step in this batch
            return
        self._step = step
        self._report_pending(trainer)
        decision = rank.step(step, loss=self._step_loss(pl_module), target=self._target)
        if decision.save:
            self._save(trainer)
        if decision.notice and self._notifier is not None:
            # Lightning's handler, on every rank at once (see _sigterm_first): it flags
            # ``trainer.received_sigterm``, and Lightning leaves by its SIGTERMException
            self._notifier(signal.SIGTERM, None)
        if decision.stop:
            trainer.should_stop = True

    def _step_loss(self, pl_module: pl.LightningModule) -> torch.Tensor | None:
        """The optimizer step's loss: Lightning's automatic optimization hands each
        accumulated batch's loss divided by their number (their sum is the step's mean);
        a manual one, what ``training_step`` returned last."""
        losses, self._losses = self._losses, []
        if not losses:
            return None
        return torch.stack(losses).sum() if pl_module.automatic_optimization else losses[-1]

    def _save(self, trainer: pl.Trainer) -> None:
        """Lightning's own checkpoint of this step, on every rank, reported."""
        began = time.perf_counter()
        path = _save_last(trainer)
        self._pending = None  # this save is reported here
        self._leave()
        self._saved_step = trainer.global_step
        rank.saved(trainer.global_step, path, stall_s=time.perf_counter() - began)

    # -- Lightning's own saves, validation, the end -----------------------------------------

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Lightning is about to write a checkpoint (its ``ModelCheckpoint``'s or ours), on
        every rank: a ``save`` phase until the next hook, which reports it."""
        if trainer.sanity_checking:
            return
        self._pending = trainer.global_step
        if self._phase is None:
            self._enter(rank.SAVING)

    def _report_pending(self, trainer: pl.Trainer) -> None:
        """Report a checkpoint Lightning wrote since the last hook (every rank, alike)."""
        stall = self._leave()
        step, self._pending = self._pending, None
        if step is None or step <= self._saved_step or not self._started:
            return
        path = _written_at(trainer, step)
        if path is not None:
            self._saved_step = step
            rank.saved(step, path, stall_s=stall)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_pending(trainer)
        self._enter("eval")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_pending(trainer)
        rank.finish()

    def _enter(self, name: str) -> None:
        self._leave()
        self._phases.enter_context(rank.phase(name))
        self._phase, self._phase_began = name, time.perf_counter()

    def _leave(self) -> float:
        """Leave the phase entered, if any; how long it lasted."""
        if self._phase is None:
            return 0.0
        self._phases.close()
        self._phase = None
        return time.perf_counter() - self._phase_began

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Lightning leaves on a SIGTERM by itself (``SIGTERMException`` at its next check,
        every rank alike when rank 0 got it): a notice not yet checkpointed at a boundary is
        checkpointed here, at the last step every rank completed, and the rank then leaves
        as a notice says (``rank.finish``). Any other exception is the job's failure."""
        self._leave()
        if not isinstance(exception, SIGTERMException) or not self._started:
            return
        if self._saved_step < trainer.global_step:
            self._save(trainer)
        rank.finish("stopped")


def _loss(outputs: Any) -> torch.Tensor | None:
    """The batch's loss, as ``on_train_batch_end`` has it (a tensor or a dict's ``loss``)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return loss.detach().float().mean() if isinstance(loss, torch.Tensor) else None


def _keeper(trainer: pl.Trainer) -> ModelCheckpoint | None:
    """The ``ModelCheckpoint`` whose ``last.ckpt`` resumes the script: the first keeping
    one (``save_last``), else the first at all."""
    found = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    keeping = [cb for cb in found if cb.save_last]
    return next(iter(keeping or found), None)


def _save_last(trainer: pl.Trainer) -> Path:
    """Write Lightning's checkpoint of this step where ``ckpt_path="last"`` finds it; its
    path. A ``ModelCheckpoint(save_last=True)`` writes it itself, as at its own steps (its
    numbered checkpoint too, where its ``every_n_train_steps`` falls on this step: it would
    skip a step already saved)."""
    keeper = _keeper(trainer)
    if keeper is not None and keeper.save_last is True:
        # ModelCheckpoint internals (2.6): what its ``on_train_batch_end`` does
        candidates = keeper._monitor_candidates(trainer)
        every = keeper._every_n_train_steps
        due = every >= 1 and trainer.global_step % every == 0
        if due and (keeper.monitor is None or keeper.monitor in candidates):
            keeper._save_topk_checkpoint(trainer, candidates)
        keeper._save_last_checkpoint(trainer, candidates)
        return Path(keeper.last_model_path)
    if keeper is not None and keeper.dirpath:
        path = Path(keeper.dirpath) / LAST
    else:
        path = Path(trainer.default_root_dir) / "checkpoints" / LAST
    if trainer.is_global_zero and path.is_symlink():  # save_last="link": a file instead
        path.unlink()
    trainer.save_checkpoint(path)
    return path


def _written_at(trainer: pl.Trainer, step: int) -> Path | None:
    """The file a ``ModelCheckpoint`` wrote last, if it wrote one at ``step``."""
    for cb in trainer.checkpoint_callbacks:
        # ModelCheckpoint internals (2.6): the step and file of its last save
        if isinstance(cb, ModelCheckpoint) and cb._last_global_step_saved == step:
            written = cb._last_checkpoint_saved or cb.last_model_path
            if written:
                return Path(written)
    return None
