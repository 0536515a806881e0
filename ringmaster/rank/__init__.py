"""``ringmaster.rank``: every reaction Ringmaster decides, in any training loop.

A loop calls a handful of functions, on every rank, in this order::

    from ringmaster import rank

    rank.register(model=model, optimizer=optimizer, scheduler=scheduler, data=loader)
    start = rank.restore()                    # the step to continue after (0: fresh)
    for step in range(start + 1, steps + 1):
        loss = train_one_step()
        if rank.step(step, loss=loss, tokens=tokens_per_step).stop:
            break
        if step % 100 == 0:
            with rank.phase("eval", bound_s=300):
                evaluate()
    rank.finish()

- **state** (:func:`register`): the model and its optimizer go through
  ``torch.distributed.checkpoint.state_dict`` (a plain module, DDP and FSDP2 alike); any
  object with ``state_dict``/``load_state_dict`` by name (a scheduler, a torchdata
  ``StatefulDataLoader``, a sampler's position); the RNGs are taken along.
- **restore** (:func:`restore`): the newest state every rank of the new world can load —
  the memory tier (this node's RAM, else the buddy node's copy), else the durable
  checkpoint, else none — loaded in place, resharded when the world size changed.
- **the step boundary** (:func:`step`): progress and the beat out, one decision in, the
  same at the same step on every rank: checkpoints (durable, asynchronous) and memory
  snapshots are taken inside, a pause blocks inside (no rank left in a collective) until
  resumed, and ``Decision.stop`` says to leave the loop.
- **phases** (:func:`phase`): evaluation, data loading, anything long without steps is
  counted under its own name and judged by its own bound by the hang watch. A notice or
  a checkpoint asked for while every rank is inside a phase is saved there, within about
  half a second (:mod:`ringmaster.rank.phase_watch`), as at the step before it; the
  loop's own checkpoint writing (the phase :data:`SAVING`) is never cut short.
- **signals**: a SIGTERM that is not the agent's own stop is a notice: the ranks
  checkpoint at the next step they all reach (or inside the phase they are all in), then
  exit; a handler a framework installed is called too, not replaced.

Loops whose framework writes the durable checkpoints itself (Hugging Face, Lightning,
accelerate: :mod:`ringmaster.integrations`) open with ``init(loop_saves=True)``: a
checkpoint decision then comes back as ``Decision.save`` and the framework's save is
reported with :func:`saved`; the memory tier is still the API's.

Outside a Ringmaster job (no agent's spec in the environment) every call is a cheap no-op
(:func:`step` returns ``CONTINUE``, :func:`restore` the step it was given or 0), so the
same script runs under plain ``torchrun`` or alone. Misuse raises :class:`RankApiError`
with one line naming it. Calls must come from the main thread, on every rank alike.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from ringmaster.rank.driver import (
    CONTINUE,
    SAVING_PHASE,
    Decision,
    Driver,
    RankApiError,
    from_env,
)
from ringmaster.rank.state import Stateful

# the phase of a loop's own checkpoint writing: a notice waits for its end
SAVING = SAVING_PHASE

__all__ = [
    "CONTINUE",
    "SAVING",
    "Decision",
    "RankApiError",
    "Stateful",
    "finish",
    "in_job",
    "init",
    "phase",
    "register",
    "restore",
    "saved",
    "step",
]

_opened: list[Driver | None] = []  # [] before init; [None] outside a job


def init(framework: str = "custom", *, loop_saves: bool = False) -> bool:
    """Open the API for this rank (any other call opens it with the defaults); whether
    this rank runs in a Ringmaster job. ``framework`` names the loop in the job's status;
    ``loop_saves``: the framework writes the durable checkpoints (see the module doc).
    Opening again returns at once."""
    if not _opened:
        _opened.append(from_env(os.environ, framework, loop_saves))
    return _opened[0] is not None


def in_job() -> bool:
    """Whether this rank runs in a Ringmaster job (opens the API)."""
    return init()


def _driver() -> Driver | None:
    init()
    return _opened[0]


def register(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    **objects: Stateful,
) -> None:
    """Say what the training state is, before :func:`restore`: ``model`` and
    ``optimizer`` (saved through ``torch.distributed.checkpoint.state_dict``), and any
    object with ``state_dict()``/``load_state_dict()`` by name. May be called more than
    once to add to it."""
    driver = _driver()
    if driver is not None:
        driver.register(model, optimizer, objects)


def restore(loop_step: int | None = None) -> int:
    """Load the newest state every rank can use, in place, and return its step (0: a
    fresh start). ``loop_step``: the step the framework already resumed from its own
    checkpoint (``loop_saves`` loops); the memory tier is used only when newer."""
    driver = _driver()
    if driver is None:
        return loop_step or 0
    return driver.restore(loop_step)


def step(
    step: int,
    *,
    loss: float | torch.Tensor | None = None,
    tokens: int | None = None,
    target: int | None = None,
) -> Decision:
    """The boundary after optimizer step ``step`` (the loop's global step, increasing),
    on every rank: reports progress (``loss``, ``tokens`` this step over all ranks, the
    ``target`` step) and returns what every rank does now. Checkpoints, memory snapshots
    and pauses happen inside; leave the loop when ``stop`` is set."""
    driver = _driver()
    if driver is None:
        return CONTINUE
    value = loss.detach().item() if isinstance(loss, torch.Tensor) else loss
    return driver.step(step, value, tokens, target)


@contextlib.contextmanager
def phase(name: str, bound_s: float | None = None) -> Iterator[None]:
    """A stretch without steps (``"eval"``, ``"data"``, :data:`SAVING` …): counted under
    its name, and judged stalled by the hang watch only past ``bound_s`` seconds (None:
    the job's hang threshold). Every rank enters the same phases at the same step; a
    notice during one is saved inside it, unless it is :data:`SAVING`."""
    driver = _driver()
    if driver is None:
        yield
        return
    with driver.phase(name, bound_s):
        yield


def saved(step: int, path: str | Path, stall_s: float = 0.0) -> None:
    """The loop's framework wrote a durable checkpoint of ``step`` at ``path`` (it blocked
    training ``stall_s`` seconds): reported as the job's checkpoint (rank 0's call counts)."""
    driver = _driver()
    if driver is not None:
        driver.saved(step, Path(path), stall_s)


def finish(outcome: Literal["completed", "stopped"] | None = None) -> None:
    """Training ended, on every rank: the final checkpoint made durable (unless the
    framework saves itself), the memory tier's RAM given back, the outcome reported
    (default: ``stopped`` after a stop decision, else ``completed``). After a notice the
    process exits here, as SIGTERM does."""
    driver = _driver()
    if driver is not None:
        driver.finish(outcome)
