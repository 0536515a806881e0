"""Run a Hugging Face ``Trainer`` script with a stopwatch on its steps, for the benches:

    python bench/hf_steps.py SCRIPT.py [SCRIPT ARGS ...]

The script runs as ``__main__`` exactly as given, except that every ``Trainer`` it builds
also gets a callback that writes one line per optimizer step to stderr, in the ranks' own
log format (``trainer t=… wall=… rank=… event=step step=… step_s=…``, and ``event=start``
when training begins), so the benches time a script that knows nothing of Ringmaster —
its users' own, run under ``torchrun`` — the same way they time a Ringmaster job. The
callback only measures: it changes nothing the ``Trainer`` does. With
``RINGMASTER_BENCH_WATCH=watch`` its events are ``watch_start``/``watch_step`` instead, to
stand beside the ``start``/``step`` lines a rank that opened the rank API writes itself.

``RINGMASTER_BENCH_BLOCKS=N`` measures the Ringmaster callback's cost inside one run: its
``on_step_end`` (everything it does at a step) runs only in alternate blocks of ``N``
steps, the same steps on every rank, and each step line says ``on=1`` or ``on=0``: both
kinds of step come from the same processes, minutes apart at most, which no comparison of
two runs can match on a machine whose runs differ by more than the cost sought.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from typing import Any

import transformers
from transformers import TrainerCallback

from ringmaster.rank.log import Log

BLOCKS = int(os.environ.get("RINGMASTER_BENCH_BLOCKS", "0"))


class Stopwatch(TrainerCallback):
    def __init__(self) -> None:
        self.log = Log(int(os.environ.get("RANK", "0")), int(os.environ.get("ATTEMPT", "0")))
        self.last = time.perf_counter()
        watch = os.environ.get("RINGMASTER_BENCH_WATCH") == "watch"
        self.prefix = "watch_" if watch else ""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.log(f"{self.prefix}start", step=state.global_step)
        self.last = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        step, said = state.global_step, {}
        if BLOCKS:
            said = {"on": int(_on(step))}
        self.log(f"{self.prefix}step", step=step, step_s=round(now - self.last, 6), **said)
        self.last = now


def _on(step: int) -> bool:
    """Whether the Ringmaster callback acts at ``step`` (alternate blocks of ``BLOCKS``)."""
    return (step - 1) // BLOCKS % 2 == 0


def _in_blocks() -> None:
    from ringmaster.integrations.hf import RingmasterCallback

    acting = RingmasterCallback.on_step_end

    def on_step_end(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if _on(state.global_step):
            acting(self, args, state, control, **kwargs)

    RingmasterCallback.on_step_end = on_step_end  # type: ignore[method-assign]


def main() -> None:
    script, *rest = sys.argv[1:]
    original = transformers.Trainer.__init__

    def timed(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.add_callback(Stopwatch())

    transformers.Trainer.__init__ = timed  # type: ignore[method-assign]
    if BLOCKS:
        _in_blocks()
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
