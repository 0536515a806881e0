"""A fork server for the tests' ranks: one interpreter per test worker that has imported
torch, the trainer, the rank API and the frameworks once, and forks a rank per launch.

Why: on two cores the suite is bound by the CPU its ranks spend importing (torch,
DeepSpeed and torchao about 3.5 s a rank, a framework's ``Trainer`` seconds more), far more
than by what they then do. A forked rank starts with all of that imported, and is
otherwise the process a cold start would make: its own environment, working directory,
arguments, stderr to its log, and ``__main__`` run as ``python -m MODULE`` or
``python SCRIPT`` would.

The server forks only while it has no thread but its main one (importing these libraries
starts none; a fork with others running would copy their locks mid-use); if it ever has,
it says so and the launcher starts ranks cold. Nothing here is used outside the tests: the
node agent's own spares are handed over, not forked (``trainer/warm.py``).

Protocol, one JSON object a line over a Unix socket per launch: the client sends
``{"argv", "env", "cwd", "log"}``; the server answers ``{"pid"}`` once forked, then
``{"returncode"}`` (Popen's: the exit status, or minus the signal) when the rank ends.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "deepspeed",
    "trainer.worker",
    "trainer.engine_deepspeed",
    "trainer.engine_fsdp",
    "ringmaster.rank",
    "transformers",
    "accelerate",
    "pytorch_lightning",
    "ringmaster.integrations.hf",
    "ringmaster.integrations.lightning",
    "ringmaster.integrations.accelerate",
)


# -- the server ----------------------------------------------------------------------------


def preload() -> None:
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # as the agent's spares import
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]


def serve(path: Path) -> None:
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.unlink(missing_ok=True)
    listener.bind(str(path))
    listener.listen(64)
    reaped_r, reaped_w = os.pipe()
    os.set_blocking(reaped_w, False)
    signal.set_wakeup_fd(reaped_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(reaped_r, selectors.EVENT_READ, "reaped")
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nobody reads the pipe past "ready"
    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                selector.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "reaped":
                with contextlib.suppress(BlockingIOError):
                    os.read(reaped_r, 512)
                _reap(children)
            else:
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                selector.unregister(conn)
                _launch(conn, listener, children, (reaped_r, reaped_w))


def _launch(
    conn: socket.socket, listener: socket.socket, children: dict[int, socket.socket], pipe: Any
) -> None:
    with conn.makefile("rb") as stream:
        line = stream.readline()
    if not line:
        conn.close()
        return
    request = json.loads(line)
    if threading.active_count() > 1 or len(list(Path("/proc/self/task").iterdir())) > 1:
        conn.sendall(b'{"refused": "the fork server has threads"}\n')
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        listener.close()
        for fd in pipe:
            os.close(fd)
        for other in children.values():
            other.close()
        conn.close()
        _become(request)
    children[pid] = conn
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
            conn.close()


def _become(request: dict[str, Any]) -> None:
    """In the forked child: the rank's process, as a cold start would have made it."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        devnull = os.open(os.devnull, os.O_RDWR)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for fd, to in ((devnull, 0), (devnull, 1), (log, 2)):
            os.dup2(fd, to)
        argv: list[str] = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# -- the client ----------------------------------------------------------------------------


def _line(conn: socket.socket, timeout: float | None) -> bytes | None:
    """One line read from ``conn`` unbuffered (nothing past it is taken from the socket);
    None if none begins within ``timeout``; b"" when the server went away. The server
    writes a line at once: once its first byte is here, the rest follows."""
    with selectors.DefaultSelector() as sel:
        sel.register(conn, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    out = b""
    while not out.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            return b""
        out += byte
    return out


class Forked:
    """A rank the server forked, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, conn: socket.socket, pid: int, argv: list[str]) -> None:
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None
        self._conn = conn

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> bool:
        line = _line(self._conn, timeout)
        if line is None:
            return False
        self.returncode = json.loads(line)["returncode"] if line else -signal.SIGKILL
        self._conn.close()
        return True


class Zygote:
    """The fork server of this test worker, started on first use."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "zygote.sock"
        with (directory / "zygote.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(self.path)],
                stdout=subprocess.PIPE,
                stderr=log,
                env={
                    **os.environ,
                    "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
                    # numpy's OpenBLAS starts a thread pool on import unless told one
                    # thread, as the ranks are (their OMP_NUM_THREADS is 1)
                    "OPENBLAS_NUM_THREADS": "1",
                },
            )
        assert self.proc.stdout is not None
        said = self.proc.stdout.readline()
        while said not in (b"ready\n", b""):  # libraries print as they import
            said = self.proc.stdout.readline()
        if not said:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the fork server did not start: see {directory / 'zygote.log'}")

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> Forked | None:
        """A rank forked from the server; None if it refuses (start it cold)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(self.path))
        request = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        answer = json.loads(_line(conn, 60) or b"{}")
        if "pid" not in answer:
            conn.close()
            return None
        return Forked(conn, answer["pid"], argv)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.path.unlink(missing_ok=True)


def run(
    zygote: Zygote | None, argv: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> tuple[int, str]:
    """``python ARGV`` to its end: forked when there is a fork server, else started cold;
    its exit status and what it wrote to stderr (stdout is dropped)."""
    with tempfile.TemporaryDirectory(prefix="zygote-run-") as tmp:
        log = Path(tmp) / "stderr.log"
        forked = zygote.spawn(argv, env, cwd, log) if zygote is not None else None
        if forked is not None:
            code = forked.wait(timeout)
            return code, log.read_text(errors="replace") if log.exists() else ""
    done = subprocess.run(
        [sys.executable, *argv],
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.returncode, done.stderr


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
