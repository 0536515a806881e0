"""The line a node agent hands a warm interpreter (``python -m trainer.warm``) to make it a
rank, and the words the interpreter answers with.

A warm interpreter has imported the training stack before any job existed; the launch
line gives it everything a rank started cold gets from ``exec``: its whole environment,
working directory, command-line arguments, log file and CPUs. They talk over a Unix
socket the agent binds and the interpreter inherits, listening, as descriptor
``$RINGMASTER_SPARE_FD``: the agent connects; the interpreter, once its imports are done,
accepts and says ``READY``; the agent sends the launch, JSON on one line; the interpreter
says ``STARTED`` once it has taken it on (environment, directory and log applied), just
before it runs the worker. A connection that ends without a launch (the agent died) sends
the interpreter back to waiting for the next agent on the same socket, for
``$RINGMASTER_SPARE_ORPHAN_S`` seconds at most, after which it exits.
"""

from __future__ import annotations

import msgspec

READY = b"ready\n"
STARTED = b"started\n"
LISTEN_FD_ENV = "RINGMASTER_SPARE_FD"
ORPHAN_S_ENV = "RINGMASTER_SPARE_ORPHAN_S"
# a user's entry script whose top-level imports the spare imports too, ahead of its launch
PRELOAD_ENV = "RINGMASTER_SPARE_PRELOAD"


class WarmLaunch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    env: dict[str, str]  # replaces the interpreter's environment whole
    cwd: str
    log: str  # opened for appending, becomes stdout and stderr
    argv: list[str] = msgspec.field(default_factory=list)  # the rank's arguments
    cpus: list[int] = msgspec.field(default_factory=list)  # empty: keep the affinity
    # a user's entry script to run as ``__main__`` with ``argv`` (as ``python SCRIPT ARGV``
    # would); empty: the built-in trainer (``trainer.worker``'s main with ``argv``)
    script: str = ""
