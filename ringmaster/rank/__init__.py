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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringmaster.rank.api import (
        CONTINUE,
        SAVING,
        Decision,
        RankApiError,
        Stateful,
        finish,
        in_job,
        init,
        phase,
        register,
        restore,
        saved,
        step,
    )

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


def __getattr__(name: str) -> Any:
    """The API's calls, loaded (torch and the driver with them) on first use: a runtime
    module such as ``ringmaster.rank.beat`` imports without them."""
    if name in __all__:
        from ringmaster.rank import api

        return getattr(api, name)
    raise AttributeError(f"module 'ringmaster.rank' has no attribute {name!r}")
