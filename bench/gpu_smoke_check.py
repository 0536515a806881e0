"""What ``bench/gpu.py --smoke`` checks of its own product path before device time is spent.

The product path (:mod:`bench.gpu_product`) brings a local cluster up and runs real jobs
through ``coordinatorctl``: on CPU, with the tiny preset, it takes a minute or two, so it
is the bench's own check rather than a test of the quality gate. ``--smoke --sections env
product`` runs it and exits 1 naming every way the result falls short of what the GPU run
will need (:func:`product_problems`); the gate tests this function on results of each
shape (``tests/bench/test_gpu_smoke_check.py``).
"""

from __future__ import annotations

from typing import Any

COLD, WARM, FP8, KILL = "tiny-bf16", "tiny-bf16-restart", "tiny-fp8", "tiny-fp8-kill"


def product_problems(product: Any) -> list[str]:
    """Every way the smoke run's product section differs from a sound one; [] if none."""
    if not isinstance(product, dict):
        return [f"the product section has no result: {product!r}"]
    missing = [
        k for k in (COLD, WARM, FP8, KILL, "summary") if not isinstance(product.get(k), dict)
    ]
    if missing:
        return [f"no result for {', '.join(missing)}"]
    cold, warm, fp8 = product[COLD], product[WARM], product[FP8]
    problems = []
    if (cold.get("state"), cold.get("ended_by"), cold.get("steps")) != ("completed", "itself", 8):
        problems.append(f"{COLD}: not completed by itself at step 8: {_said(cold)}")
    if [step for step, _ in cold.get("checkpoint_stalls_s") or []] != [3, 6, 8]:
        problems.append(f"{COLD}: checkpoints at {cold.get('checkpoint_stalls_s')}, not 3, 6, 8")
    if not (_positive(cold.get("first_stall_s")) and _positive(cold.get("later_stall_s"))):
        problems.append(f"{COLD}: no first and later checkpoint stall")
    if not _positive(cold.get("tokens_per_s")) or cold.get("mfu") is not None:
        problems.append(f"{COLD}: tokens/s {cold.get('tokens_per_s')}, MFU {cold.get('mfu')}")
    for label, run in ((WARM, warm), (FP8, fp8)):
        if run.get("state") != "failed" or not str(run.get("ended_by", "")).startswith("bench"):
            problems.append(f"{label}: not ended by the bench at its step count: {_said(run)}")
    plan = fp8.get("float8") or []
    if not plan or not all(str(f).endswith("=tensorwise") for f in plan):
        problems.append(f"{FP8}: float8 plan {plan}, not tensorwise")
    if not (len(cold.get("compile_s") or []) == len(warm.get("compile_s") or []) == 1):
        problems.append(f"compile_s cold {cold.get('compile_s')} warm {warm.get('compile_s')}")
    summary = product["summary"]
    if summary.get(f"{COLD}_compile_s_cold") != (cold.get("compile_s") or [None])[0]:
        problems.append(f"summary: cold compile {summary.get(f'{COLD}_compile_s_cold')}")
    if not _positive(summary.get("tiny_fp8_over_bf16")) or "tiny_fp8_ge_bf16" not in summary:
        problems.append(f"summary: no fp8 over bf16 figure: {summary}")
    restart = product[KILL].get("restart")
    if not isinstance(restart, dict) or "error" in restart:
        problems.append(f"{KILL}: no restart figures: {restart}")
    elif not (
        restart.get("resumed_from", -1) >= 3
        and restart.get("steps_redone", -1) >= 0
        and 0 < restart.get("start_s", 0) <= restart.get("seconds_to_next_step", 0) < 120
    ):
        problems.append(f"{KILL}: restart figures out of bounds: {restart}")
    return problems


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and value > 0


def _said(run: dict[str, Any]) -> str:
    fields = ("state", "ended_by", "steps", "reason")
    return ", ".join(f"{k} {run.get(k)!r}" for k in fields)
