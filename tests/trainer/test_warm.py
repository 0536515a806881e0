"""``python -m trainer.warm``: an interpreter that becomes a rank when handed a launch line.

Real processes throughout: a stand-in ``main`` shows what the rank sees (environment,
directory, arguments, log, stdin, CPUs) and how its status becomes the exit status; one
test runs the real worker through a warm interpreter for a short 1-rank job."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from proto.job import JobSpec
from proto.warm import LISTEN_FD_ENV, ORPHAN_S_ENV, READY, STARTED, WarmLaunch
from ringmaster.rank.checkpoint import default_staging_dir

REPO = Path(__file__).resolve().parents[2]

# A stand-in for trainer.worker.main: prints what a rank would see, returns $CODE, or
# raises what $RAISE names.
STAND_IN = textwrap.dedent(
    """
    import os, sys
    from trainer.warm import serve

    def main(argv):
        print("cwd", os.getcwd())
        print("argv", argv, sys.argv[1:])
        print("env", os.environ.get("ONLY_IN_RANK"), os.environ.get("ONLY_IN_SPARE"))
        print("stdin", repr(sys.stdin.read()))
        print("cpus", sorted(os.sched_getaffinity(0)))
        print("to stderr", file=sys.stderr)
        if os.environ.get("RAISE") == "exit":
            raise SystemExit("bad spec")
        if os.environ.get("RAISE") == "error":
            raise RuntimeError("boom")
        return int(os.environ.get("CODE", "0"))

    serve(main)
    """
)


class Warm:
    """A warm interpreter as the agent drives it: a socket it inherits listening, then
    READY, a launch line, STARTED on the agent's connection."""

    def __init__(self, argv: list[str], env: dict[str, str], path: Path) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(path))
            listener.listen(1)
            fd = listener.fileno()
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                env={**env, LISTEN_FD_ENV: str(fd)},
                pass_fds=(fd,),
                start_new_session=True,
            )
        self.path = path
        self.connect()

    def connect(self) -> None:
        """As an agent does, its own or a successor's."""
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.settimeout(60)
        self.conn.connect(str(self.path))
        self.words = self.conn.makefile("rb")

    def leave(self) -> None:
        """As an agent that dies does: its end of the connection closes."""
        self.words.close()
        self.conn.close()

    def ready(self) -> bytes:
        return self.words.readline()

    def launch(self, launch: WarmLaunch) -> bytes:
        self.conn.sendall(msgspec.json.encode(launch) + b"\n")
        return self.words.readline()


@pytest.fixture
def warm(tmp_path: Path) -> Iterator[list[Warm]]:
    started: list[Warm] = []
    yield started
    for w in started:
        w.leave()
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait()


def stand_in(tmp_path: Path, warm: list[Warm], **extra: str) -> Warm:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    env = {**os.environ, "PYTHONPATH": str(REPO), "ONLY_IN_SPARE": "spare", **extra}
    warm.append(Warm([sys.executable, str(script)], env, tmp_path / "spare.sock"))
    assert warm[-1].ready() == READY
    return warm[-1]


def rank_env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "ONLY_IN_RANK": "rank", **extra}


def test_a_launch_line_makes_it_the_rank(tmp_path: Path, warm: list[Warm]) -> None:
    w = stand_in(tmp_path, warm)
    workdir = tmp_path / "work"
    workdir.mkdir()
    log = workdir / "rank-0.log"
    log.write_text("earlier attempt\n")
    cpu = min(os.sched_getaffinity(0))
    launch = WarmLaunch(
        env=rank_env(CODE="7"), cwd=str(workdir), log=str(log), argv=["--x", "1"], cpus=[cpu]
    )
    assert w.launch(launch) == STARTED
    assert w.proc.wait(30) == 7
    assert w.proc.stdout is not None and w.proc.stdout.read() == b""  # the log took fd 1
    assert w.words.read() == b""  # and the connection is closed: it is a rank now
    text = log.read_text()
    assert text.startswith("earlier attempt\n")  # appended, like a rank started cold
    assert f"pid {w.proc.pid} runs this rank (warm" in text
    for line in (
        f"cwd {workdir}",
        "argv ['--x', '1'] ['--x', '1']",
        "env rank None",  # the environment is the rank's, whole
        "stdin ''",  # /dev/null, not the agent's pipe
        f"cpus [{cpu}]",
        "to stderr",
    ):
        assert line in text.splitlines(), (line, text)


@pytest.mark.parametrize(("raised", "said"), [("exit", "bad spec"), ("error", "boom")])
def test_an_exception_leaves_as_the_interpreter_would(
    tmp_path: Path, warm: list[Warm], raised: str, said: str
) -> None:
    w = stand_in(tmp_path, warm)
    log = tmp_path / "rank.log"
    assert w.launch(WarmLaunch(env=rank_env(RAISE=raised), cwd=str(tmp_path), log=str(log))) == (
        STARTED
    )
    assert w.proc.wait(30) == 1  # as python exits on SystemExit("...") or an exception
    assert said in log.read_text()


def test_an_agent_gone_without_a_launch_leaves_it_for_the_next_agent(
    tmp_path: Path, warm: list[Warm]
) -> None:
    """A spare outlives an agent that dies: it answers the next agent's connection, and
    with no agent for $RINGMASTER_SPARE_ORPHAN_S it ends quietly."""
    w = stand_in(tmp_path, warm, **{ORPHAN_S_ENV: "1"})
    w.leave()  # the agent died
    w.connect()  # its successor
    assert w.ready() == READY
    w.leave()
    assert w.proc.wait(30) == 0


def test_a_spare_that_became_a_rank_refuses_a_later_agent(tmp_path: Path, warm: list[Warm]) -> None:
    w = stand_in(tmp_path, warm)
    launch = WarmLaunch(env=rank_env(CODE="0"), cwd=str(tmp_path), log=str(tmp_path / "r.log"))
    assert w.launch(launch) == STARTED
    assert w.proc.wait(30) == 0
    with pytest.raises(ConnectionRefusedError):
        w.connect()


def test_a_launch_it_cannot_take_is_refused_before_started(
    tmp_path: Path, warm: list[Warm]
) -> None:
    w = stand_in(tmp_path, warm)
    missing = tmp_path / "no-such-dir"
    launch = WarmLaunch(env=rank_env(), cwd=str(missing), log=str(tmp_path / "rank.log"))
    assert w.launch(launch) == b""  # no STARTED: the agent starts the rank cold instead
    assert w.proc.wait(30) == 1


# ``python -m trainer.warm`` with what the rank imports after its launch written to its log
LATE_IMPORTS = textwrap.dedent(
    """
    import sys
    from trainer.warm import preload, serve

    main = preload()
    before = set(sys.modules)

    def run(argv):
        try:
            return main(argv)
        finally:
            print("late imports:", *sorted(set(sys.modules) - before), file=sys.stderr)

    serve(run)
    """
)
# what took seconds of every warm restart when it was imported by the rank, not the spare
HEAVY = ("torch._inductor", "torch._dynamo", "setuptools", "deepspeed.runtime.zero.muon")


@pytest.mark.slow
def test_the_real_worker_trains_in_a_warm_interpreter(
    tmp_path: Path, warm: list[Warm], make_spec: Callable[..., JobSpec]
) -> None:
    """A warm interpreter with the training stack preloaded runs a 1-rank DeepSpeed FP8
    job to its end, with the same log, checkpoint and exit status as ``python -m
    trainer.worker``, and imports nothing heavy once it is the rank."""
    spec = make_spec(
        train={"engine": "deepspeed", "steps": 3, "precision": "fp8", "fp8_recipe": "tensorwise"},
        checkpoint={"every_steps": 3},
    )
    spec_path = tmp_path / "spec.json"
    spec_path.write_bytes(msgspec.json.encode(spec))
    script = tmp_path / "late_imports.py"
    script.write_text(LATE_IMPORTS)
    job = f"warm-{tmp_path.name}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    warm.append(Warm([sys.executable, str(script)], env, tmp_path / "spare.sock"))
    w = warm[-1]
    assert w.ready() == READY
    rank = {
        **env,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
        "RINGMASTER_JOB_SPEC": str(spec_path),
        "RINGMASTER_JOB_ID": job,
        "RINGMASTER_WORKDIR": str(tmp_path),
    }
    log = tmp_path / "rank-0.log"
    try:
        assert w.launch(WarmLaunch(env=rank, cwd=str(tmp_path), log=str(log))) == STARTED
        assert w.proc.wait(90) == 0, log.read_text()
    finally:
        subprocess.run(["rm", "-rf", str(default_staging_dir(job, tmp_path))], check=False)
    text = log.read_text()
    assert "event=started" in text and "event=model_built" in text
    assert "engine=deepspeed-zero1" in text
    assert "event=finished step=3 outcome=completed" in text
    assert (tmp_path / "ckpt" / "latest").exists()
    late = next(line for line in text.splitlines() if line.startswith("late imports:")).split()
    assert late[2:] and not [m for m in late[2:] if m.startswith(HEAVY)], late


def test_a_spare_for_a_script_preloads_its_libraries_not_the_user_s_own_modules(
    tmp_path: Path,
) -> None:
    from trainer.warm_scripts import script_imports

    (tmp_path / "mymodel.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(
        "import os, json\n"
        "import torch.distributed as dist\n"
        "from transformers import Trainer\n"
        "from mymodel import Net\n"
        "from . import sibling\n"
        "def main():\n"
        "    import accelerate\n"
    )
    assert script_imports(script) == ["os", "json", "torch.distributed", "transformers"]
    assert script_imports(tmp_path / "missing.py") == []
    (tmp_path / "broken.py").write_text("import (")
    assert script_imports(tmp_path / "broken.py") == []
