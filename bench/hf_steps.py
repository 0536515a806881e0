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
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from typing import Any

import transformers
from transformers import TrainerCallback

from trainer.log import Log


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
        self.log(f"{self.prefix}step", step=state.global_step, step_s=round(now - self.last, 6))
        self.last = now


def main() -> None:
    script, *rest = sys.argv[1:]
    original = transformers.Trainer.__init__

    def timed(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.add_callback(Stopwatch())

    transformers.Trainer.__init__ = timed  # type: ignore[method-assign]
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
