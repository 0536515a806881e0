"""Built-in model sizes, from a CPU-test toy to a billion parameters.

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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Dimensions are multiples of 16 so every linear can run in float8 (torch._scaled_mm needs it).
# The LM head is tied to the token embedding, as in GPT-2; counts below include it once.
PRESETS: dict[str, ModelConfig] = {
    # byte-level, ~0.5M parameters: a few steps a second on one CPU core
    "tiny": ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_seq_len=512),
    # ~27M
    "small": ModelConfig(vocab_size=16384, d_model=512, n_layers=6, n_heads=8, max_seq_len=1024),
    # GPT-2 sizes (vocab padded to a multiple of 64): ~124M, ~354M, ~1.3B
    "125m": ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "350m": ModelConfig(vocab_size=50304, d_model=1024, n_layers=24, n_heads=16, max_seq_len=1024),
    "1b3": ModelConfig(vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, max_seq_len=2048),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name``; a ValueError naming the valid ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        valid = ", ".join(PRESETS)
        raise ValueError(f"unknown model preset {name!r} (expected one of: {valid})") from None
