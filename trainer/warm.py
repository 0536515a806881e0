"""``python -m trainer.warm``: a rank's interpreter, imported before its rank is needed.

A rank started cold pays for the interpreter and for importing torch, DeepSpeed and
torchao (seconds on every restart) before it does anything for its job. The node agent
(``nodeagent.warm_pool``) starts this interpreter once: it imports what the worker needs
(:func:`preload`), then serves the agent on the listening socket it inherited
(``proto.warm``) as the node's *template* (``trainer.warm_template``): it forks a spare
whenever the agent asks, each fork an interpreter with all of that imported, for
milliseconds of CPU instead of seconds. ``coordinatorctl up`` starts one the same way for
all of a local cluster's agents, which share it. A spare says ``READY`` to the agent's connection
and blocks on one launch line; given one, it becomes the rank exactly as ``exec`` would
have made it (``trainer.warm_rank``) and runs ``trainer.worker.main``.

Both outlive their agent as ranks do: a connection that ends without a launch (the agent
died, ``kill -9`` or a crash) sends them back to accepting, and the restarted agent finds
their sockets in the run directory and connects again. No agent within
``$RINGMASTER_SPARE_ORPHAN_S`` seconds (the node is going away) ends them quietly.

CUDA is not initialised here: which devices a rank sees (``CUDA_VISIBLE_DEVICES``) and how
it allocates are read when CUDA starts, and that must be the rank's environment. DeepSpeed
picks its accelerator on import by asking torch whether CUDA is available, so the imports
run with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (NVML answers; the CUDA driver stays
unloaded). numpy's OpenBLAS starts a pool of a thread per core but one on import, which
would keep the template from forking: unless the environment says otherwise, the imports
run with ``OPENBLAS_NUM_THREADS=1``, what a rank started cold gets anyway from the
``OMP_NUM_THREADS=1`` its launch carries. Settings read at import time by these libraries
cannot change afterwards; the agent starts a rank cold when its environment differs from
the interpreter's in one of them (``nodeagent.spare.import_time_difference``).

A user's entry script (``[job] entry = ["train.py", …]``) is served too
(``trainer.warm_scripts``): the launch names the script, and the spare runs it as
``__main__``. Once a job of that script ran on the node, the agent asks the template to
import the script's libraries as well (``proto.warm.Preload``), and an interpreter started
after that (``$RINGMASTER_SPARE_PRELOAD``) imports them at its start.

Importing this module costs nothing heavy: :func:`preload` does the imports, and
:func:`serve` takes any ``main``, which is how tests drive it without the trainer. Until
the hand-over, whatever is printed (DeepSpeed prints on import) goes to the pool's log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import NoReturn

from proto.warm import LISTEN_FD_ENV, PRELOAD_ENV
from trainer import warm_template
from trainer.warm_scripts import Main, preload_script

# set while importing, unless the environment sets them: NVML answers torch's CUDA check
# (the driver stays unloaded); OpenBLAS starts no thread pool
IMPORT_SETTINGS = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "OPENBLAS_NUM_THREADS": "1"}


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """:data:`IMPORT_SETTINGS` in the environment while the libraries import."""
    before = {name: os.environ.get(name) for name in IMPORT_SETTINGS}
    for name, setting in IMPORT_SETTINGS.items():
        os.environ.setdefault(name, setting)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def preload() -> Main:
    """Import everything the worker imports, and what it imports late (DeepSpeed, FSDP,
    torchao's float8), without starting CUDA; the worker's ``main``."""
    with importing():
        import deepspeed
        import torch
        import torch.distributed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        with contextlib.suppress(ImportError):
            import torchao.float8
            import torchao.float8.float8_linear
            import torchao.float8.fsdp_utils  # noqa: F401
        # imported late by what a rank calls, and seconds each on every restart:
        # DeepSpeed's ZeRO optimizer check imports its Muon optimizer, whose module calls
        # torch.compile (TorchInductor's import); torchao's float8 conversion patches
        # Inductor's codegen; DeepSpeed's op probe imports its builders and setuptools
        # (the probe itself asks the devices, so it stays the rank's)
        import deepspeed.ops.op_builder.all_ops
        import setuptools  # noqa: F401
        import torch._inductor.codegen.triton
        import torch._inductor.compile_fx  # noqa: F401

        with contextlib.suppress(ImportError):
            import deepspeed.runtime.zero.muon.muon_optimizer
        import trainer.engine_deepspeed
        import trainer.engine_fsdp  # noqa: F401
        from trainer import worker

        if script := os.environ.get(PRELOAD_ENV):
            preload_script(script)
    return worker.main


def _preload_script(script: str) -> None:
    with importing():
        preload_script(script)


def serve(main: Main, *, started: float | None = None) -> NoReturn:
    """Serve agents on the inherited socket as the node's template until one hands a
    launch, become that rank and run ``main``; never returns. ``started``: when the
    imports began (for the rank's log)."""
    listener = socket.socket(fileno=int(os.environ[LISTEN_FD_ENV]))
    listener.set_inheritable(False)  # nothing the rank starts may hold it
    took = "" if started is None else f"imports took {time.monotonic() - started:.2f} s"
    warm_template.serve(listener, main, preload=_preload_script, note=took or "template")


if __name__ == "__main__":
    begun = time.monotonic()
    serve(preload(), started=begun)
