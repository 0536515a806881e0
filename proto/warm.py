"""The line a node agent hands a warm interpreter (``python -m trainer.warm``) to make it a
rank, and the words the interpreter answers with on its stdout.

A warm interpreter has imported the training stack before any job existed; the launch
line gives it everything a rank started cold gets from ``exec``: its whole environment,
working directory, command-line arguments, log file and CPUs. It is JSON, one line, on the
interpreter's stdin; the interpreter says ``READY`` once its imports are done and ``STARTED``
once it has taken the launch on (environment, directory and log applied), just before it
runs the worker.
"""

from __future__ import annotations

import msgspec

READY = b"ready\n"
STARTED = b"started\n"


class WarmLaunch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    env: dict[str, str]  # replaces the interpreter's environment whole
    cwd: str
    log: str  # opened for appending, becomes stdout and stderr
    argv: list[str] = msgspec.field(default_factory=list)  # trainer.worker's arguments
    cpus: list[int] = msgspec.field(default_factory=list)  # empty: keep the affinity
