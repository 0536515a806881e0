"""``train.auto_micro_batch``: the largest micro-batch that fits in free GPU memory.

Starting at ``train.micro_batch_size``, each try runs one forward + backward of the real
model at that size; a CUDA out-of-memory error halves the size (down to 1) after releasing
the failed try's memory back to the allocator. The try also holds a block the size of
AdamW's two moment buffers, which the first real optimizer step allocates, so the chosen
size still fits once training starts (ZeRO partitions those buffers: there it errs on the
small side). Every rank probes its own GPU and all use the smallest size any of them
found, as DDP and ZeRO need the same batch shape on every rank.

On CPU there is nothing to probe (host memory is not the limit this sizes for): the
requested size is kept and the log says so.

The chosen size changes which samples a step reads (see :mod:`trainer.data`), so a job
resumed on GPUs with a different amount of free memory may continue with another data
order; set the size by hand where that matters.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ringmaster.rank.log import Log
from trainer.model import lm_loss
from trainer.precision import Precision, autocast_context

Attempt = Callable[[int], None]  # runs one training-sized step at a micro-batch size


def largest_fitting(start: int, attempt: Attempt, release: Callable[[], None]) -> int:
    """The first of ``start, start // 2, …, 1`` at which ``attempt`` raises no
    ``torch.cuda.OutOfMemoryError``; re-raises the error if even 1 does not fit.
    ``release`` runs between tries, outside the ``except`` block: until then the
    exception's traceback keeps the failed try's tensors alive."""
    size = start
    while True:
        try:
            attempt(size)
            return size
        except torch.cuda.OutOfMemoryError:
            if size == 1:
                raise
        release()
        size //= 2


def release_cuda_memory() -> None:
    """Hand the cached blocks of a failed try back, so the next try starts clean."""
    gc.collect()
    torch.cuda.empty_cache()


def forward_backward(
    model: nn.Module, seq_len: int, vocab_size: int, precision: Precision, device: torch.device
) -> Attempt:
    """An :data:`Attempt` that runs ``model`` forward and backward on random tokens and
    leaves no gradients behind."""
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    autocast = autocast_context(precision, device)
    # Its own generator: the probe must not shift the RNG stream training draws from.
    generator = torch.Generator(device=device).manual_seed(0)

    def attempt(size: int) -> None:
        reserve = torch.empty(2 * param_bytes, dtype=torch.uint8, device=device)
        try:
            tokens = torch.randint(
                0, vocab_size, (size, seq_len), device=device, generator=generator
            )
            with autocast():
                logits = model(tokens)
            lm_loss(logits, tokens).backward()
        finally:
            del reserve
            model.zero_grad(set_to_none=True)

    return attempt


def agree_on_minimum(size: int, device: torch.device) -> int:
    """The smallest ``size`` over all ranks (one all_reduce MIN on the job's group)."""
    value = torch.tensor([size], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


def choose_micro_batch(
    requested: int,
    device: torch.device,
    attempt: Attempt,
    log: Log,
    *,
    agree: Callable[[int], int] | None = None,
    release: Callable[[], None] = release_cuda_memory,
) -> int:
    """The micro-batch size every rank trains with: on CUDA the largest fitting one
    (agreed across ranks by ``agree``, by default :func:`agree_on_minimum`), on CPU
    ``requested`` unchanged."""
    if device.type != "cuda":
        log("micro_batch", size=requested, auto="skipped", reason="no-cuda-device")
        return requested
    free, total = torch.cuda.mem_get_info(device)
    found = largest_fitting(requested, attempt, release)
    release()  # the winning try's activations are cached too
    chosen = agree(found) if agree is not None else agree_on_minimum(found, device)
    log(
        "micro_batch",
        size=chosen,
        auto="probed",
        requested=requested,
        fits_here=found,
        free_gib=round(free / 2**30, 2),
        total_gib=round(total / 2**30, 2),
    )
    return chosen
