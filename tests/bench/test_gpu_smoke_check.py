"""The product path's smoke check (``bench/gpu.py --smoke --sections env product``, the
bench's own check before device time is spent): a sound result passes, and each way a
result can fall short is named."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from bench.gpu_smoke_check import product_problems


def sound() -> dict[str, Any]:
    """A product section as a sound CPU smoke run writes it (the shape of a real one)."""
    ended = {"state": "failed", "ended_by": "bench, at its step count", "steps": 3}
    return {
        "settings": {"seq_len": 32},
        "tiny-bf16": {
            "state": "completed",
            "ended_by": "itself",
            "steps": 8,
            "checkpoint_stalls_s": [[3, 0.21], [6, 0.05], [8, 0.04]],
            "first_stall_s": 0.21,
            "later_stall_s": 0.045,
            "tokens_per_s": 812.0,
            "mfu": None,
            "compile_s": [9.1],
        },
        "tiny-bf16-restart": {**ended, "compile_s": [1.2]},
        "tiny-fp8": {**ended, "steps": 6, "float8": ["blocks.*.mlp.fc=tensorwise"]},
        "tiny-fp8-kill": {
            "state": "failed",
            "restart": {
                "resumed_from": 3,
                "steps_redone": 1,
                "start_s": 2.5,
                "seconds_to_next_step": 4.0,
            },
        },
        "summary": {
            "tiny_fp8_over_bf16": 0.4,
            "tiny_fp8_ge_bf16": False,
            "tiny-bf16_compile_s_cold": 9.1,
            "tiny-bf16_compile_s_warm": 1.2,
        },
    }


def test_a_sound_result_has_no_problem() -> None:
    assert product_problems(sound()) == []


Change = Callable[[dict[str, Any]], None]
BROKEN: dict[str, tuple[Change, str]] = {
    "no section": (lambda p: p.clear(), "no result for"),
    "cold job failed": (lambda p: p["tiny-bf16"].update(state="failed"), "not completed"),
    "a checkpoint missing": (
        lambda p: p["tiny-bf16"]["checkpoint_stalls_s"].pop(),
        "not 3, 6, 8",
    ),
    "no later stall": (lambda p: p["tiny-bf16"].update(later_stall_s=None), "checkpoint stall"),
    "an MFU on a CPU": (lambda p: p["tiny-bf16"].update(mfu=0.3), "MFU"),
    "restart job ran to its end": (
        lambda p: p["tiny-bf16-restart"].update(ended_by="itself"),
        "not ended by the bench",
    ),
    "float8 in rowwise": (
        lambda p: p["tiny-fp8"].update(float8=["blocks.*.mlp.fc=rowwise"]),
        "not tensorwise",
    ),
    "never compiled warm": (lambda p: p["tiny-bf16-restart"].update(compile_s=[]), "compile_s"),
    "no fp8 figure": (lambda p: p["summary"].pop("tiny_fp8_over_bf16"), "fp8 over bf16"),
    "rank never killed": (
        lambda p: p["tiny-fp8-kill"].update(restart={"error": "the rank was never killed"}),
        "no restart figures",
    ),
    "resumed before the kill's checkpoint": (
        lambda p: p["tiny-fp8-kill"]["restart"].update(resumed_from=0),
        "out of bounds",
    ),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_shortfall_is_named(name: str) -> None:
    change, said = BROKEN[name]
    product = copy.deepcopy(sound())
    change(product)
    problems = product_problems(product)
    assert problems and any(said in p for p in problems), problems


def test_a_section_that_failed_is_a_problem() -> None:
    assert product_problems(None) == ["the product section has no result: None"]
