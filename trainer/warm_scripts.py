"""A user's entry script in a warm interpreter (``trainer.warm``): which libraries to import
ahead of its launch, and how its rank runs it.

A spare runs the script as ``__main__`` with the launch's arguments, as ``python train.py
…`` would, torch already imported. Once a job of the script ran on the node, the agent has
the node's template interpreter import the libraries the script imports at its top level
too (a framework's import takes seconds: ``transformers`` about 3.5 s of CPU here), best
effort: modules beside the script (the user's own) are left to the script, and one that
fails to import is only logged.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

Main = Callable[[Sequence[str]], int]


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
            raise  # the interpreter's way: die of SIGINT (``trainer.warm_rank``)
        except BaseException:
            traceback.print_exc()
            code = 1
        return termination.record_exit(code)

    return main
