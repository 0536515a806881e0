"""The template (``trainer.warm_template``) with real processes: it imports once and forks
spares that become ranks as a spare started on its own would (environment, directory,
log, CPUs, own session); it leaves the status of a forked rank in its exit record, a
signal's too; it forks nothing once it has a thread; it imports a script's libraries once
for every fork; it serves several agents at once, each on its own connection, says who it
is, and forks into the asking agent's network namespace; it and its forks wait for the
next agent, then end on their own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec
import pytest

from proto.warm import (
    LISTEN_FD_ENV,
    ORPHAN_S_ENV,
    READY,
    STARTED,
    Fork,
    Forked,
    Identify,
    Identity,
    Preload,
    Preloaded,
    WarmLaunch,
)
from ringmaster.procs import pid_alive, start_time, wait_until
from ringmaster.rundir import ExitRecord, read_exit

REPO = Path(__file__).resolve().parents[2]

# A stand-in template: counts its starts (the imports it would do), starts a thread when
# told to, then serves a main that prints what its rank sees and returns $CODE after
# sleeping $SLEEP.
TEMPLATE = textwrap.dedent(
    """
    import os, sys, threading, time
    with open(os.environ["STARTS"], "a") as f:
        f.write("x")
    if os.environ.get("THREAD"):
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    from trainer.warm import serve

    def main(argv):
        print("cwd", os.getcwd())
        print("env", os.environ.get("ONLY_IN_RANK"), os.environ.get("ONLY_IN_TEMPLATE"))
        print("cpus", sorted(os.sched_getaffinity(0)))
        print("session", os.getsid(0) == os.getpid())
        print("netns", os.stat("/proc/self/ns/net").st_ino)
        time.sleep(float(os.environ.get("SLEEP", "0")))
        return int(os.environ.get("CODE", "0"))

    serve(main)
    """
)


class Agent:
    """The agent's side of a template: its connection, requests and forks."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.tmp_path = tmp_path
        script = tmp_path / "template.py"
        script.write_text(TEMPLATE)
        self.path = tmp_path / "template.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(self.path))
            listener.listen(1)
            fd = listener.fileno()
            self.proc = subprocess.Popen(
                [sys.executable, str(script)],
                stdin=subprocess.DEVNULL,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join([str(REPO), env.pop("PYTHONPATH", "")]),
                    "STARTS": str(tmp_path / "starts"),
                    "ONLY_IN_TEMPLATE": "template",
                    LISTEN_FD_ENV: str(fd),
                    **env,
                },
                pass_fds=(fd,),
                start_new_session=True,
            )
        self.forks: list[int] = []
        self.connect()

    def connect(self) -> None:
        self.conn, self.words = self.join()

    def join(self) -> tuple[socket.socket, BinaryIO]:
        """One more agent's connection to the same template, READY read."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(60)
        conn.connect(str(self.path))
        words = conn.makefile("rb")
        assert words.readline() == READY
        return conn, words

    def leave(self) -> None:
        self.words.close()
        self.conn.close()

    def ask(self, request: Fork | Preload) -> bytes:
        self.conn.sendall(msgspec.json.encode(request) + b"\n")
        return self.words.readline()

    def fork(self, netns: str = "") -> tuple[int, Path]:
        """A spare forked from the template, and its socket (READY already read)."""
        path = self.tmp_path / f"spare-{len(self.forks)}.sock"
        forked = msgspec.json.decode(self.ask(Fork(socket=str(path), netns=netns)), type=Forked)
        assert forked.pid, forked
        self.forks.append(forked.pid)
        return forked.pid, path

    def launch(self, spare: Path, launch: WarmLaunch) -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(60)
            conn.connect(str(spare))
            words = conn.makefile("rb")
            assert words.readline() == READY
            conn.sendall(msgspec.json.encode(launch) + b"\n")
            return words.readline()

    def starts(self) -> int:
        return len((self.tmp_path / "starts").read_text())


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    made: list[Agent] = []
    yield made
    for agent in made:
        agent.leave()
        for pid in [*agent.forks, agent.proc.pid]:
            if pid_alive(pid):
                os.killpg(pid, signal.SIGKILL)
        agent.proc.wait()


def template(tmp_path: Path, agents: list[Agent], **env: str) -> Agent:
    agents.append(Agent(tmp_path, **env))
    return agents[-1]


def launch(tmp_path: Path, name: str, **env: str) -> WarmLaunch:
    workdir = tmp_path / name
    workdir.mkdir()
    return WarmLaunch(
        env={"PATH": os.environ["PATH"], "ONLY_IN_RANK": name, **env},
        cwd=str(workdir),
        log=str(workdir / "rank.log"),
        exit_record=str(workdir / "rank.exit"),
    )


def exited(record: Path, pid: int) -> ExitRecord:
    """The exit record the template left, once the rank is reaped."""
    return wait_until(lambda: start_time(pid) is None and read_exit(record), 30)


def test_forks_become_ranks_of_their_own_and_the_template_imports_once(
    tmp_path: Path, agents: list[Agent]
) -> None:
    agent = template(tmp_path, agents)
    cpu = min(os.sched_getaffinity(0))
    for code, name in ((7, "a"), (0, "b")):
        pid, spare = agent.fork()
        assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(
            agent.proc.pid
        ), "the template's child"
        rank = launch(tmp_path, name, CODE=str(code))
        rank.cpus = [cpu]
        assert agent.launch(spare, rank) == STARTED
        assert exited(Path(rank.exit_record), pid) == ExitRecord(pid, code)
        lines = Path(rank.log).read_text().splitlines()
        assert f"trainer.warm: pid {pid} runs this rank (warm, forked from pid " in lines[0]
        for line in (f"cwd {rank.cwd}", f"env {name} None", f"cpus [{cpu}]", "session True"):
            assert line in lines, (line, lines)
    assert agent.starts() == 1  # two spares, one start (and its imports)
    assert agent.proc.poll() is None  # still the template


def test_a_forked_rank_killed_by_a_signal_leaves_the_signal_in_its_record(
    tmp_path: Path, agents: list[Agent]
) -> None:
    agent = template(tmp_path, agents)
    pid, spare = agent.fork()
    rank = launch(tmp_path, "a", SLEEP="600")
    assert agent.launch(spare, rank) == STARTED
    wait_until(lambda: "session" in Path(rank.log).read_text(), 30)
    os.kill(pid, signal.SIGKILL)
    assert exited(Path(rank.exit_record), pid) == ExitRecord(pid, -signal.SIGKILL)


def test_an_idle_spare_leaves_no_record(tmp_path: Path, agents: list[Agent]) -> None:
    agent = template(tmp_path, agents)
    pid, _ = agent.fork()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: start_time(pid) is None, 30)  # reaped by the template
    _, spare = agent.fork()  # which forks on
    rank = launch(tmp_path, "a")
    assert agent.launch(spare, rank) == STARTED


def test_a_template_with_a_thread_forks_nothing(tmp_path: Path, agents: list[Agent]) -> None:
    agent = template(tmp_path, agents, THREAD="1")
    said = msgspec.json.decode(agent.ask(Fork(socket=str(tmp_path / "s.sock"))), type=Forked)
    assert said == Forked(threads=1)
    assert not (tmp_path / "s.sock").exists()


def test_a_scripts_libraries_are_imported_once_for_every_fork(
    tmp_path: Path, agents: list[Agent]
) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "marker_lib.py").write_text(
        f"with open({str(tmp_path / 'imported')!r}, 'a') as f:\n    f.write('x')\n"
    )
    script = tmp_path / "user" / "train.py"
    script.parent.mkdir()
    script.write_text(
        "import sys\n"
        "print('preloaded', 'marker_lib' in sys.modules)\n"
        "import marker_lib\n"
        "sys.exit(3)\n"
    )
    agent = template(tmp_path, agents, PYTHONPATH=str(libs))
    said = msgspec.json.decode(agent.ask(Preload(script=str(script))), type=Preloaded)
    assert said.script == str(script)
    for name in ("a", "b"):
        pid, spare = agent.fork()
        rank = launch(tmp_path, name, PYTHONPATH=str(libs))
        rank.script = str(script)
        assert agent.launch(spare, rank) == STARTED
        assert exited(Path(rank.exit_record), pid) == ExitRecord(pid, 3)
        assert "preloaded True" in Path(rank.log).read_text().splitlines()
    assert (tmp_path / "imported").read_text() == "x"


def test_the_template_and_its_forks_wait_for_the_next_agent_then_end(
    tmp_path: Path, agents: list[Agent]
) -> None:
    agent = template(tmp_path, agents, **{ORPHAN_S_ENV: "1"})
    agent.leave()  # the agent died
    agent.connect()  # its successor
    pid, _ = agent.fork()
    agent.leave()
    assert agent.proc.wait(30) == 0
    wait_until(lambda: start_time(pid) is None, 30)  # the fork ended too, and was reaped


def test_a_template_handed_a_launch_leaves_a_successor_that_forks_on(
    tmp_path: Path, agents: list[Agent]
) -> None:
    """It was still importing when the launch came: it forks the template that goes on,
    on a socket of its own, then becomes the rank; its imports serve the next forks."""
    agent = template(tmp_path, agents)
    rank = launch(tmp_path, "a", CODE="4")
    rank.successor = str(tmp_path / "successor.sock")
    agent.conn.sendall(msgspec.json.encode(rank) + b"\n")
    successor = msgspec.json.decode(agent.words.readline(), type=Forked).pid
    assert successor and agent.words.readline() == STARTED
    assert agent.proc.wait(30) == 4  # the template, our child, was the rank
    agent.forks.append(successor)
    assert os.getsid(successor) == successor  # a session of its own
    agent.leave()
    agent.path = Path(rank.successor)
    agent.connect()  # the successor says READY on its own socket
    pid, spare = agent.fork()
    second = launch(tmp_path, "b", CODE="6")
    assert agent.launch(spare, second) == STARTED
    assert exited(Path(second.exit_record), pid) == ExitRecord(pid, 6)
    assert agent.starts() == 1


def test_several_agents_are_served_at_once_each_on_its_own_connection(
    tmp_path: Path, agents: list[Agent]
) -> None:
    """The agents of a machine share one template: a request half sent on one connection
    holds up none on another, each answer comes on its own connection, and one agent
    leaving ends nothing of the other's."""
    agent = template(tmp_path, agents)
    other, words = agent.join()
    line = msgspec.json.encode(Fork(socket=str(tmp_path / "first.sock"))) + b"\n"
    agent.conn.sendall(line[:10])  # the first agent's request, half sent
    other.sendall(msgspec.json.encode(Identify()) + b"\n")
    said = msgspec.json.decode(words.readline(), type=Identity)
    assert said.pid == agent.proc.pid and said.env["ONLY_IN_TEMPLATE"] == "template"
    other.sendall(msgspec.json.encode(Fork(socket=str(tmp_path / "second.sock"))) + b"\n")
    second = msgspec.json.decode(words.readline(), type=Forked).pid
    agent.conn.sendall(line[10:])
    first = msgspec.json.decode(agent.words.readline(), type=Forked).pid
    agent.forks += [first, second]
    assert first and second and first != second
    agent.leave()  # the first agent stops: the other's spare and template serve on
    rank = launch(tmp_path, "a", CODE="5")
    assert agent.launch(tmp_path / "second.sock", rank) == STARTED
    assert exited(Path(rank.exit_record), second) == ExitRecord(second, 5)
    agent.conn, agent.words = other, words
    _, spare = agent.fork()
    assert agent.launch(spare, launch(tmp_path, "b")) == STARTED
    assert agent.starts() == 1


@pytest.fixture
def other_netns() -> Iterator[Path]:
    """A network namespace other than ours, held by a process (root's: else skipped)."""
    try:
        holder = subprocess.Popen(["unshare", "--net", "sleep", "600"], stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        pytest.skip("no unshare command")
    path, ours = Path(f"/proc/{holder.pid}/ns/net"), Path("/proc/self/ns/net").stat().st_ino
    try:
        wait_until(lambda: holder.poll() is not None or path.stat().st_ino != ours, 10)
        if holder.poll() is not None:
            pytest.skip("no network namespace can be made here (root only)")
        yield path
    finally:
        holder.kill()
        holder.wait()


def test_a_fork_enters_the_asking_agents_network_namespace(
    tmp_path: Path, agents: list[Agent], other_netns: Path
) -> None:
    """A shared template runs in the host's namespace, an agent of ``up --netns`` in its
    node's: the fork, a rank to be, goes where that agent's ranks live, and its socket,
    a path, is reached from both."""
    agent = template(tmp_path, agents)
    own = Path(f"/proc/{os.getpid()}/ns/net")
    for name, netns in (("a", other_netns), ("b", own)):  # own: the template's, none entered
        pid, spare = agent.fork(netns=str(netns))
        rank = launch(tmp_path, name, CODE="2")
        assert agent.launch(spare, rank) == STARTED
        assert exited(Path(rank.exit_record), pid) == ExitRecord(pid, 2)
        assert f"netns {netns.stat().st_ino}" in Path(rank.log).read_text().splitlines()
