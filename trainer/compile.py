"""``train.compile``: regional ``torch.compile`` of the transformer blocks, with the compiled
code cached on the node.

Uncompiled, every elementwise op of a block is its own kernel; under float8 that includes
torchao's amax reductions, scale computations and casts around each matmul, which made the
float8 path slower than BF16 on an H200. Compiling fuses them (torchao's README: "enable
torch.compile for competitive performance").

Regional: each block is compiled (``nn.Module.compile``, in place, so parameter names and
checkpoints do not change), not the whole model. The blocks are identical, so one graph is
traced and compiled once and serves all of them (PyTorch's "regional compilation" recipe);
the embedding, loss and optimizer stay eager. Blocks are compiled before the engine wraps
the model: before FSDP2's ``fully_shard``, as torchtitan does (activation checkpointing,
then compile, then FSDP), before DDP and before ``deepspeed.initialize``. ``compile`` is
lazy, so tracing happens in the first step whatever the wrapper. Under ZeRO-3, DeepSpeed's
parameter hooks on the block's submodules are ``torch.compiler.disable``'d: the block still
compiles, split around them.

The cache: Inductor's FX graph cache and the AOTAutograd cache (compiled forward and
backward, Triton kernels included) live in ``TORCHINDUCTOR_CACHE_DIR``, which points at a
node-local persistent directory: ``RINGMASTER_COMPILE_CACHE`` when the agent or operator
sets it, else ``TORCHINDUCTOR_CACHE_DIR`` if already set, else a per-user directory in the
node's temp dir. A restarted rank, or a later job of the same shapes, loads the compiled
code instead of compiling again (entries are keyed by graph, configuration and versions).
``train.compile`` unset means on with CUDA, off on CPU (Inductor's CPU code needs a C
compiler and minutes; CPU runs are for correctness).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ringmaster import rank_env

CACHE_ENV = rank_env.COMPILE_CACHE
# Test hook: a cheaper backend than Inductor (``aot_eager``) for CPU tests of the wiring.
BACKEND_ENV = "RINGMASTER_TEST_COMPILE_BACKEND"


def wanted(setting: bool | None, device: torch.device) -> bool:
    """``train.compile`` resolved: unset means on CUDA only."""
    return device.type == "cuda" if setting is None else setting


def cache_dir(env: Mapping[str, str]) -> Path:
    """The node's compile cache directory (see the module docstring)."""
    for name in (CACHE_ENV, "TORCHINDUCTOR_CACHE_DIR"):
        if env.get(name):
            return Path(env[name])
    return Path(tempfile.gettempdir()) / f"ringmaster-compile-cache-{os.getuid()}"


def use_cache(directory: Path) -> None:
    """Point Inductor's caches at ``directory`` and turn on the persistent ones (before the
    first compile: Inductor reads the directory when it first needs it)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)  # Triton's cache goes under it
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    if hasattr(functorch_config, "enable_autograd_cache"):  # torch >= 2.6
        functorch_config.enable_autograd_cache = True


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile each of ``model.blocks`` in place (lazily: tracing happens on the first
    call); returns how many. Static shapes: a job's micro-batch and sequence length are
    fixed, and static kernels are the fastest."""
    blocks = list(model.get_submodule("blocks").children())
    for block in blocks:
        block.compile(backend=backend, dynamic=False)
    return len(blocks)


class CompileClock:
    """``compile_s``: how much longer this process's first step took than its second.

    Compiling (tracing, Inductor, Triton autotuning; or loading all that from the cache)
    happens inside the first step's forward and backward; the second step runs the
    compiled code, so the difference is what compiling cost (plus the first step's other
    one-off work, such as cuBLAS and allocator warm-up, which an eager run pays too)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.times: list[float] = []

    def record(self, step_s: float) -> float | None:
        """Record a step's duration; returns compile_s once, after the second step."""
        if not self.enabled or len(self.times) >= 2:
            return None
        self.times.append(step_s)
        if len(self.times) < 2:
            return None
        return max(0.0, self.times[0] - self.times[1])
