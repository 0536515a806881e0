"""Driving the stub NVML library from tests: its state, and child processes that load it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from nodeagent.sim import nvml_stub
from nodeagent.sim.nvml_state import StubState

REPO = Path(__file__).resolve().parents[2]


class GpuNode:
    """A directory holding the stub ``libnvidia-ml.so.1`` and the state it answers from,
    and child processes that load it (one library per process, as pynvml does)."""

    def __init__(self, directory: Path, state: StubState) -> None:
        self.dir = directory
        self.state = state
        self.library = directory / nvml_stub.LIBRARY
        self._children: list[subprocess.Popen[str]] = []

    def write(self) -> None:
        self.state.write(self.dir)

    def child(self, *, by_path: bool = False, library_dir: Path | None = None) -> NvmlChild:
        """A collector process finding the library through ``LD_LIBRARY_PATH`` (the way
        pynvml's by-name load works on a node) or, with ``by_path``, the nvml_library
        setting."""
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        argv = [sys.executable, str(Path(__file__).with_name("nvml_child.py"))]
        if by_path:
            argv.append(str(self.library))
        else:
            env["LD_LIBRARY_PATH"] = str(library_dir or self.dir)
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
        )
        self._children.append(proc)
        return NvmlChild(proc)

    def close(self) -> None:
        for proc in self._children:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=10)


class NvmlChild:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def ask(self, command: dict[str, object]) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"child exited with {self.proc.wait()}"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def collect(self, collector: str = "gpu") -> dict[str, Any]:
        answer = self.ask({"collect": collector})
        assert answer["ok"], answer
        values: dict[str, Any] = answer["values"]
        return values
