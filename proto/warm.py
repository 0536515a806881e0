"""The lines a node agent hands a warm interpreter (``python -m trainer.warm``) to make it a
rank or to fork spares from it, and the words and lines the interpreter answers with.

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

The interpreter the agent starts is a *template*: before any launch, the agent may send it
any number of :class:`Fork` and :class:`Preload` lines on the same connection, each
answered with one JSON line (:class:`Forked`, :class:`Preloaded`). A fork is a spare: a
child of the template listening on the socket the request names, which talks to the agent
as above (``READY``, one launch, ``STARTED``) and never forks itself. Every line the agent
sends is one of :data:`Request`, told apart by its ``type``. A template serves any number
of connections at once, each request answered on the connection it came on (the agents of
one machine may share a template: ``WARM_TEMPLATE_ENV``); an agent that did not start it
asks who it is first (:class:`Identify`), and never hands it a launch. A launch handed to
the template itself (it was still importing) names where its successor listens: the
template forks it first, answers :class:`Forked`, then becomes the rank as a spare does,
and the successor goes on as the template on its new socket (the agent connects to it
there).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

READY = b"ready\n"
STARTED = b"started\n"
LISTEN_FD_ENV = "RINGMASTER_SPARE_FD"
ORPHAN_S_ENV = "RINGMASTER_SPARE_ORPHAN_S"
# a user's entry script whose top-level imports the interpreter imports too, at its start
PRELOAD_ENV = "RINGMASTER_SPARE_PRELOAD"
# how many spares an agent keeps (``nodeagent --warm-ranks``; ``coordinatorctl up``
# passes its environment on, and starts no shared template when it is 0)
WARM_RANKS_ENV = "RINGMASTER_WARM_RANKS"
# the socket of a template an agent uses instead of starting its own
# (``nodeagent --warm-template-socket``)
WARM_TEMPLATE_ENV = "RINGMASTER_WARM_TEMPLATE_SOCKET"


def warm_ranks(environ: Mapping[str, str]) -> int | None:
    """The spares ``WARM_RANKS_ENV`` asks for; None when it says no number."""
    value = environ.get(WARM_RANKS_ENV, "").strip()
    return int(value) if value.isdigit() else None


class WarmLaunch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="launch"):
    env: dict[str, str]  # replaces the interpreter's environment whole
    cwd: str
    log: str  # opened for appending, becomes stdout and stderr
    argv: list[str] = msgspec.field(default_factory=list)  # the rank's arguments
    cpus: list[int] = msgspec.field(default_factory=list)  # empty: keep the affinity
    # a user's entry script to run as ``__main__`` with ``argv`` (as ``python SCRIPT ARGV``
    # would); empty: the built-in trainer (``trainer.worker``'s main with ``argv``)
    script: str = ""
    # the rank's exit record (``ringmaster.rundir.exit_beside``): where the template writes
    # the status it reaps when a spare it forked ends as this rank; empty: none
    exit_record: str = ""
    # for a template handed this launch: where the template that goes on after it listens
    # (it forks that successor first, and says so with a :class:`Forked` line before
    # ``STARTED``); empty: none (a spare, or an interpreter that is no template)
    successor: str = ""


class Fork(msgspec.Struct, forbid_unknown_fields=True, tag="fork"):
    """Fork a spare listening on a new socket at ``socket`` (the template binds it before
    it answers, so the agent may connect as soon as it reads the answer). ``netns``: the
    asking agent's network namespace (``/proc/<pid>/ns/net``), which the spare enters
    when it is not the template's (a template the machine's agents share); empty: the
    template's."""

    socket: str
    netns: str = ""


class Preload(msgspec.Struct, forbid_unknown_fields=True, tag="preload"):
    """Import what ``script`` imports (``trainer.warm_scripts.preload_script``), so the
    spares forked from now on have it imported."""

    script: str


class Identify(msgspec.Struct, forbid_unknown_fields=True, tag="identify"):
    """Who the template is, asked by an agent that did not start it (:class:`Identity`)."""


Request = WarmLaunch | Fork | Preload | Identify


class Forked(msgspec.Struct, kw_only=True):
    """A fork's answer: the spare's PID, or why there is none. ``threads`` (besides the main
    one) means this template never forks: a child of a process with other threads may
    inherit a lock one of them held."""

    pid: int = 0
    threads: int = 0
    error: str = ""


class Preloaded(msgspec.Struct, kw_only=True):
    script: str
    imports_s: float  # how long the imports took (the template's CPU, not a rank's)


class Identity(msgspec.Struct, kw_only=True):
    """A template's PID and the environment it started with, which it imported in: a rank
    whose environment differs in what is read at import time starts cold."""

    pid: int
    env: dict[str, str]
