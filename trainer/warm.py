"""``python -m trainer.warm``: a rank's interpreter, started before its rank is needed.

A rank started cold pays for the interpreter and for importing torch, DeepSpeed and
torchao (seconds on every restart) before it does anything for its job. The node agent
keeps a few of these interpreters ready (``nodeagent.warm_pool``): each imports what the
worker needs, then serves the agent on the listening socket it inherited
(``proto.warm``): it says ``READY`` to the agent's connection and blocks on one launch
line. Given one, it becomes the rank exactly as ``exec`` would have made it: environment
replaced whole, working directory, the rank's log on fds 1 and 2, ``/dev/null`` on fd 0,
CPU affinity for every thread; it says ``STARTED`` (so the agent knows the hand-over
took), closes the socket and runs ``trainer.worker.main``, leaving with its status the
way ``python -m trainer.worker`` does (``os._exit`` after flushing).

It outlives its agent as ranks do: a connection that ends without a launch (the agent
died, ``kill -9`` or a crash) sends it back to accepting, and the restarted agent finds
its socket in the run directory and connects again. No agent within
``$RINGMASTER_SPARE_ORPHAN_S`` seconds (the node is going away) ends it quietly, status 0.

CUDA is not initialised here: which devices a rank sees (``CUDA_VISIBLE_DEVICES``) and how
it allocates are read when CUDA starts, and that must be the rank's environment. DeepSpeed
picks its accelerator on import by asking torch whether CUDA is available, so the import
runs with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (NVML answers; the CUDA driver stays
unloaded). Settings read at import time by these libraries cannot change afterwards;
the agent starts a rank cold when its environment differs from the interpreter's in one
of them (``nodeagent.warm_pool.import_time_difference``).

A user's entry script (``[job] entry = ["train.py", …]``) is served too: the launch names
the script, and the spare runs it as ``__main__`` with the launch's arguments, as
``python train.py …`` would, torch already imported. A spare started for a script
(``$RINGMASTER_SPARE_PRELOAD``, set by the agent once a job of that script ran on the node)
also imports the libraries the script imports at its top level (a framework's import takes
seconds: ``transformers`` about 3.5 s of CPU here), best effort: modules beside the script
(the user's own) are left to the script, and one that fails to import is only logged.

Importing this module costs nothing heavy: :func:`preload` does the imports, and
:func:`serve` takes any ``main``, which is how tests drive it without the trainer. Until
the hand-over, whatever is printed (DeepSpeed prints on import) goes to the pool's log.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import logging
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import msgspec

from proto.warm import LISTEN_FD_ENV, ORPHAN_S_ENV, PRELOAD_ENV, READY, STARTED, WarmLaunch

Main = Callable[[Sequence[str]], int]
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
ORPHAN_S = 60.0  # how long to wait for a restarted agent (systemd restarts it in seconds)


def preload() -> Main:
    """Import everything the worker imports, and what it imports late (DeepSpeed, FSDP,
    torchao's float8), without starting CUDA; the worker's ``main``."""
    before = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
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
    finally:
        if before is None:
            os.environ.pop(NVML_CHECK, None)
        else:
            os.environ[NVML_CHECK] = before
    return worker.main


def script_imports(script: Path) -> list[str]:
    """The libraries ``script`` imports at its top level: absolute imports of modules that
    are not beside it (those are the user's own, left to the script). None if unreadable."""
    try:
        tree = ast.parse(script.read_bytes(), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    beside = {p.stem for p in script.parent.iterdir()} if script.parent.is_dir() else set()
    return [n for n in dict.fromkeys(names) if n.split(".")[0] not in beside]


def preload_script(script: str) -> None:
    """Import what ``script`` imports (:func:`script_imports`), each failure logged."""
    for name in script_imports(Path(script)):
        try:
            importlib.import_module(name)
        except Exception as exc:  # the script will meet it itself, with its own environment
            print(f"trainer.warm: preloading {name} for {script}: {exc}", file=sys.stderr)


def script_main(script: str) -> Main:
    """``main`` for a user's entry script: run it as ``__main__``, as ``python SCRIPT ARGV``
    would (its directory first on the path), its exit record left as the worker's is."""

    def main(argv: Sequence[str]) -> int:
        from ringmaster.rank import termination
        from ringmaster.rank.launch import exit_record

        termination.record_exit_in(exit_record(os.environ))
        if threads := os.environ.get("OMP_NUM_THREADS", "").strip():
            # OpenMP read it as the spare imported torch, from the spare's environment;
            # the worker applies it itself, and so must a script's rank (as cold it would)
            import torch

            with contextlib.suppress(ValueError):
                torch.set_num_threads(max(1, int(threads)))
        sys.argv = [script, *argv]
        sys.path.insert(0, str(Path(script).resolve().parent))
        code = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            raise  # the interpreter's way: die of SIGINT (``_run``)
        except BaseException:
            traceback.print_exc()
            code = 1
        return termination.record_exit(code)

    return main


def serve(main: Main, *, started: float | None = None) -> NoReturn:
    """Serve agents on the inherited socket until one hands a launch, become that rank and
    run ``main``; never returns."""
    listener = socket.socket(fileno=int(os.environ[LISTEN_FD_ENV]))
    listener.set_inheritable(False)  # nothing the rank starts may hold it
    orphan_s = float(os.environ.get(ORPHAN_S_ENV) or ORPHAN_S)
    ready = time.monotonic()
    while True:
        listener.settimeout(orphan_s)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            os._exit(0)  # no agent came back for it: the node is going away
        conn.settimeout(None)
        line = _launch_line(conn)
        if line is not None:
            break
        conn.close()  # the agent went away without a launch: wait for its successor
    try:
        launch = msgspec.json.decode(line, type=WarmLaunch)
        log_fd = _apply(launch)
    except (msgspec.DecodeError, msgspec.ValidationError, OSError) as exc:
        print(f"trainer.warm: cannot take the launch: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # no STARTED: the agent starts this rank cold instead
    listener.close()  # a restarted agent's connect is refused: this is a rank now
    with contextlib.suppress(OSError):  # an agent gone since its launch: the rank runs on
        conn.sendall(STARTED)
    conn.close()  # the agent's end sees EOF: the hand-over is complete
    _redirect(log_fd)
    imports = "" if started is None else f", imports took {ready - started:.2f} s"
    print(
        f"trainer.warm: pid {os.getpid()} runs this rank (warm{imports}, "
        f"idle {time.monotonic() - ready:.2f} s)",
        file=sys.stderr,
        flush=True,
    )
    code = _run(script_main(launch.script) if launch.script else main, launch.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _launch_line(conn: socket.socket) -> bytes | None:
    """READY to the agent, then its launch line; None when the connection ends first."""
    try:
        conn.sendall(READY)
        with conn.makefile("rb") as stream:
            line = stream.readline()
    except OSError:
        return None
    return line if line.strip() else None


def _apply(launch: WarmLaunch) -> int:
    """Environment, directory, CPUs; the log opened. Nothing is redirected yet, so a
    failure here still reaches the pool's log."""
    os.environ.clear()  # unsetenv/putenv: C libraries reading getenv see the rank's too
    os.environ.update(launch.env)
    os.chdir(launch.cwd)
    fd = os.open(launch.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    if launch.cpus:
        # here, not at the top: the rank runtime's package imports torch, and importing
        # this module costs nothing heavy (``preload`` has imported it by now)
        from ringmaster.rank.thread_cpu import task_ids

        available = os.sched_getaffinity(0)
        chosen = {c for c in launch.cpus if c in available} or available
        # sched_setaffinity(0) is the calling thread only; imports may have started others
        for tid in task_ids():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, chosen)
    return fd


def _redirect(log_fd: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(devnull)
    os.close(log_fd)


def _run(main: Main, argv: Sequence[str]) -> int:
    """``main``'s status as the interpreter would have made it its exit status."""
    module = sys.modules.get(getattr(main, "__module__", ""))
    sys.argv = [getattr(module, "__file__", None) or sys.argv[0], *argv]
    try:
        return main(list(argv))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # as the interpreter does: die of SIGINT, so the parent sees the signal
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    begun = time.monotonic()
    serve(preload(), started=begun)
