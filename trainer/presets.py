"""Built-in model sizes, from a CPU-test toy to three billion parameters.

Job files name a preset rather than spelling out dimensions, so every node in a job (and a
resumed job) builds exactly the same architecture and checkpoints stay loadable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    max_seq_len: int


# Dimensions are multiples of 16 so every linear can run in float8 (torch._scaled_mm needs it).
# The LM head is tied to the token embedding, as in GPT-2; counts below include it once.
PRESETS: dict[str, ModelConfig] = {
    # byte-level, ~0.5M parameters: a few steps a second on one CPU core
    "tiny": ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_seq_len=512),
    # ~28M
    "small": ModelConfig(vocab_size=16384, d_model=512, n_layers=6, n_heads=8, max_seq_len=1024),
    # GPT-2 sizes (vocab padded to a multiple of 64): ~124M, ~355M, ~1.3B
    "125m": ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "350m": ModelConfig(vocab_size=50304, d_model=1024, n_layers=24, n_heads=16, max_seq_len=1024),
    "1b3": ModelConfig(vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, max_seq_len=2048),
    # ~3.1B, head dim 128. One H200 (141 GB) trains it with DeepSpeed ZeRO-1 and AdamW, N =
    # 3.11e9: bf16 weights and gradients 2N + 2N = 12.4 GB, fp32 master copy 4N = 12.4 GB,
    # Adam's two fp32 moments 8N = 24.8 GB, the fp32 gradient partition of the step 4N =
    # 12.4 GB: 62 GB of state. Activations at micro-batch 8 x 2048 tokens with activation
    # checkpointing: the 26 block inputs in bf16 (26 * 8 * 2048 * 3072 * 2 B = 2.6 GB), one
    # block recomputed at a time (about 14 bf16 (b, t, d) tensors, 1.4 GB; attention is
    # fused, no t x t matrix) and the logits (8 * 2048 * 50304 in bf16, again in fp32 for
    # the loss, and their gradient: about 10 GB). About 76 GB in all; without checkpointing
    # the saved activations alone (~34 bytes per token per d_model per layer: 44 GB) would
    # leave little room.
    "3b": ModelConfig(vocab_size=50304, d_model=3072, n_layers=26, n_heads=24, max_seq_len=2048),
}

# The size each preset is documented as having (above), checked against param_count by
# the tests.
NOMINAL_PARAMS: dict[str, float] = {
    "tiny": 0.5e6,
    "small": 28e6,
    "125m": 124e6,
    "350m": 355e6,
    "1b3": 1.3e9,
    "3b": 3.1e9,
}


def param_count(cfg: ModelConfig) -> int:
    """Parameters of :class:`trainer.model.GPT` for ``cfg``, by formula: token embedding
    (tied to the head, counted once), position table, final LayerNorm and per block two
    LayerNorms (2d each), qkv (3d² + 3d), attention projection (d² + d), MLP up (4d² + 4d)
    and down (4d² + d)."""
    d = cfg.d_model
    per_block = 12 * d * d + 13 * d
    return cfg.vocab_size * d + cfg.max_seq_len * d + cfg.n_layers * per_block + 2 * d


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; a ValueError naming the valid ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        valid = ", ".join(PRESETS)
        raise ValueError(f"unknown model preset {name!r} (expected one of: {valid})") from None
