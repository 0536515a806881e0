"""Building the stub ``libnvidia-ml.so.1`` (``nvml_stub.c``) and installing it per node.

pynvml opens ``libnvidia-ml.so.1`` by name, once per process, so a simulated node (or a test)
gets a directory holding the library and its ``nvml-state.txt``; the agent finds it through
``LD_LIBRARY_PATH`` or the ``gpu.nvml_library`` setting. Compiling takes a fraction of a
second, but a cluster of simulated nodes would pay it per node, so builds are cached by the
hash of the source and the compiler command, and nodes get hard links to the cached file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("nvml_stub.c")
LIBRARY = "libnvidia-ml.so.1"
_FLAGS = ["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", f"-Wl,-soname,{LIBRARY}"]


class StubBuildError(RuntimeError):
    """No C compiler, or the stub did not compile: simulated GPUs are then unavailable."""


def build(cache: Path, compiler: str = "gcc") -> Path:
    """The compiled stub under ``cache/<hash>/``, compiling it only if not already there."""
    cc = shutil.which(compiler)
    if cc is None:
        raise StubBuildError(f"no C compiler ({compiler}) to build the NVML stub")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + "\0".join([compiler, *_FLAGS]).encode()).hexdigest()[:16]
    target = cache / digest / LIBRARY
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{LIBRARY}.{os.getpid()}")
    result = subprocess.run(
        [cc, *_FLAGS, "-o", str(partial), str(SOURCE), "-lpthread"],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise StubBuildError(f"building the NVML stub failed: {result.stderr.strip()[:2000]}")
    partial.replace(target)  # atomic: concurrent builders race harmlessly
    return target


def install(directory: Path, cache: Path) -> Path:
    """``directory/libnvidia-ml.so.1``, linked to the cached build (copied across devices)."""
    built = build(cache)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / LIBRARY
    partial = directory / f".{LIBRARY}.tmp"
    partial.unlink(missing_ok=True)
    try:
        partial.hardlink_to(built)
    except OSError:
        shutil.copy2(built, partial)
    partial.replace(target)
    return target
