"""The rank API's calls (:mod:`ringmaster.rank` re-exports them): what a training loop
calls at start, at every step boundary and around its own phases. Apart from the package so
that importing one of the runtime's modules (the beat, the log, stacks) costs no torch: the
package loads this module, and with it torch and the driver, on the first use of a call."""

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
