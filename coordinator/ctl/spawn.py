"""How the local cluster starts its processes, and starts an agent again: each detached
(its own session), its output appended to its log in ``DIR/logs`` (whose last line an
error may quote), its PID in ``DIR/pids``, and how it was started (argv, environment,
working directory) beside it, so a crashed agent is started again as systemd would from
its unit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import msgspec

from coordinator.ctl import netns as ns
from coordinator.ctl.errors import CtlError
from coordinator.ctl.home import agent_process, pid_file, pids_dir
from ringmaster.auth import ENV as ENV_CREDS
from ringmaster.procs import pid_alive, read_pid, wait_until


def daemon_env() -> dict[str, str]:
    """A daemon's environment: ours, less the caller's creds (each process gets its own by
    flag)."""
    return {k: v for k, v in os.environ.items() if k != ENV_CREDS} | {"PYTHONUNBUFFERED": "1"}


def spawn(
    name: str,
    argv: list[str],
    directory: Path,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    fds: tuple[int, ...] = (),
) -> int:
    """Start ``name`` detached, its output appended to its log, its PID in ``pids/``;
    ``env`` None: :func:`daemon_env`; ``fds``: descriptors it inherits."""
    env = daemon_env() if env is None else env
    with (directory / "logs" / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
            cwd=cwd,
            pass_fds=fds,
        )
    pid_file(directory, name).write_text(str(proc.pid))
    launch = {"argv": argv, "env": env, "cwd": cwd}
    _launch_file(directory, name).write_bytes(msgspec.json.encode(launch))
    return proc.pid


def _launch_file(directory: Path, name: str) -> Path:
    """How ``name`` was started (argv, environment, working directory): a crashed agent
    is started again from it, as systemd would from its unit."""
    return pids_dir(directory) / f"{name}.launch.json"


def restart_agent(directory: Path, node: str, timeout: float = 15.0) -> str:
    """The agent of ``node`` crashes and is started again as systemd's ``Restart=`` would:
    SIGKILL, then the same command line, environment, working directory and log file
    (read from ``/proc`` before the kill), its new PID in ``pids/``. Its ranks live on."""
    name = agent_process(node)
    pid = read_pid(pid_file(directory, name))
    if pid is None or not pid_alive(pid):
        return _start_again(directory, node, name)
    proc = Path(f"/proc/{pid}")
    try:
        argv = [os.fsdecode(a) for a in (proc / "cmdline").read_bytes().split(b"\0")[:-1]]
        pairs = (
            os.fsdecode(e).partition("=") for e in (proc / "environ").read_bytes().split(b"\0")
        )
        env = {key: value for key, sep, value in pairs if sep}
        cwd = str((proc / "cwd").readlink())
    except OSError as exc:
        raise CtlError(f"cannot read how the agent of {node} was started: {exc.strerror}") from None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    try:
        wait_until(lambda: not pid_alive(pid), timeout)
    except TimeoutError:
        raise CtlError(
            f"the agent of {node} (pid {pid}) outlived SIGKILL for {timeout:.0f} s"
        ) from None
    # /proc shows the agent's own argv: a namespaced one is started in its namespace again
    started = spawn(
        name, [*ns.wrapper(ns.read(directory), node), *argv], directory, env=env, cwd=cwd
    )
    return f"restarted the agent of {node}: killed pid {pid}, started pid {started}"


def _start_again(directory: Path, node: str, name: str) -> str:
    """The agent of ``node`` is already dead (a lost machine, repaired): start it as it
    was started the last time."""
    try:
        launch = msgspec.json.decode(_launch_file(directory, name).read_bytes(), type=_Launch)
    except (OSError, msgspec.DecodeError):
        raise CtlError(f"no record of how the agent of {node} was started") from None
    started = spawn(name, launch.argv, directory, env=launch.env, cwd=launch.cwd)
    return f"started the agent of {node} again (it was not running): pid {started}"


class _Launch(msgspec.Struct):
    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None


def last_line(log: Path) -> str:
    """The log's last line, cut to a readable length ("nothing" for an empty or absent
    log): what an agent that never registered last said, in the one-line error."""
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1][:200] if lines else "nothing"
