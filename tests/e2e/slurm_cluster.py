"""A real Slurm for end-to-end tests, started and stopped by the test itself.

Debian's ``munged``, one ``slurmctld`` on the host and one ``slurmd`` per node of an
``up --netns`` cluster, each in that node's network namespace and in a UTS namespace of
its own whose hostname is the node's id, so ``slurmd`` finds its own ``NodeName`` by
hostname as on a real machine, and answers on the node's own address on the control
bridge; jobs, their ``Prolog`` and their batch scripts run there, beside that node's agent.
All run in the foreground as children of the test, configured by a ``slurm.conf`` of the
test's own (``SLURM_CONF``): no systemd, nothing in ``/etc``. Every process is stopped
when the test ends (the cluster's ``down`` removes the namespaces). Where Slurm cannot run
(not root, packages missing, no namespaces), the test skips, saying why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cli_harness import netns_unavailable

from coordinator.ctl.netns import Netns
from ringmaster.procs import wait_until
from ringmaster.slurm import SlurmNode, parse_nodes

NEEDED = (
    "munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "squeue",
    "sacct", "nsenter", "unshare", "hostname",
)  # fmt: skip
# Slurm's own delay before a requeued job may start again is the job credential's
# lifetime plus one second (default 120 s); a short one keeps the test short.
CONF = """\
ClusterName={cluster}
SlurmctldHost=localhost({host_addr})
SlurmctldPort={ctld_port}
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket={sockets}/munge.socket,cred_expire=5
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={sockets}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={sockets}/spool/%n/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerParameters=sched_interval=1,nohold_on_prolog_fail
Prolog={dir}/prolog
ReturnToService=2
SlurmdTimeout=10
JobRequeue=1
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.log
{nodes}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


def unavailable() -> str:
    """Why a real Slurm cannot run here ("" when it can)."""
    if os.geteuid() != 0:
        return "a real Slurm needs root (slurmd runs jobs as their users)"
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): see scripts/bootstrap.sh"
    return netns_unavailable()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Slurm:
    def __init__(self, directory: Path, nodes: list[str]) -> None:
        self.dir, self.names = directory, nodes
        self.conf = directory / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # Unix sockets (munge's, each step's in the spool) need paths under 108 bytes,
        # which a test's own directory may exceed
        self.sockets = Path(tempfile.mkdtemp(prefix="rm-slurm-", dir="/tmp"))

    def write(self, net: Netns) -> None:
        (self.dir / "state").mkdir(parents=True, exist_ok=True)
        for name in self.names:
            (self.sockets / "spool" / name).mkdir(parents=True, exist_ok=True)
        # the second node weighs least: a 1-node job lands there first
        lines = [
            f"NodeName={name} NodeAddr={net.nodes[name].ctl_addr} CPUs=1 Weight={2 - (i == 1)}"
            for i, name in enumerate(self.names)
        ]
        self.prolog("exit 0")
        self.conf.write_text(
            CONF.format(
                cluster=f"rm{os.getpid()}",
                host_addr=net.host_addr,
                ctld_port=free_port(),
                dir=self.dir,
                sockets=self.sockets,
                nodes="\n".join(lines),
            )
        )
        key = self.dir / "munge.key"
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
        key.chmod(0o600)

    def prolog(self, body: str) -> None:
        """The job prolog every node runs before a job's first step there (a non-zero exit
        drains the node and requeues the job)."""
        script = self.dir / "prolog"
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)

    def start(self, net: Netns | None) -> None:
        """Slurm on the nodes of the namespaced cluster ``net`` (None: the cluster is not
        namespaced, and the test skips)."""
        if net is None:
            pytest.skip("a Slurm per node needs the cluster up with --netns")
        self.write(net)
        d = self.dir
        self._spawn(
            "munged",
            [
                "munged", "-F", "--force", f"--key-file={d}/munge.key",
                f"--socket={self.sockets}/munge.socket", f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed",
            ],
        )  # fmt: skip
        wait_until(lambda: (self.sockets / "munge.socket").exists(), 15, 0.05)
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        wait_until(lambda: self.run("scontrol", "ping").returncode == 0, 30, 0.2)
        for name in self.names:
            # in the node's network namespace, with the node's id as its own hostname
            # (nsenter, not ``ip netns exec``, whose fresh /sys lacks the cgroup mounts
            # slurmd reads)
            netns = f"--net=/run/netns/{net.nodes[name].namespace}"
            namespace = ["nsenter", netns, "unshare", "--uts"]
            self._spawn(name, [*namespace, "sh", "-c", f"hostname {name} && exec slurmd -D"])
        wait_until(lambda: self._all_idle(self.nodes()), 30, 0.3)

    def _all_idle(self, nodes: dict[str, SlurmNode]) -> bool:
        return len(nodes) == len(self.names) and all(n.state == "idle" for n in nodes.values())

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.dir / f"{name}.out").open("wb")
        self.procs[name] = subprocess.Popen(argv, env=self.env, stdout=log, stderr=log)

    def kill(self, name: str) -> None:
        """SIGKILL one daemon (a node's ``slurmd``: the machine is gone for Slurm)."""
        self.procs[name].kill()
        self.procs[name].wait()

    def stop(self) -> None:
        """Every job killed (its batch script, not a child of ours, must not outlive its
        slurmd), then every daemon."""
        jobs = self.run("squeue", "--noheader", "--format=%A").stdout.split()
        if jobs and self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.run("scancel", *jobs)
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: not self.run("squeue", "--noheader").stdout.strip(), 15, 0.2)
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # a job's slurmstepd outlives its slurmd by design, and so would a job's script:
        # whatever carries this cluster's configuration in its environment goes too
        for pid in self.strays():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.sockets, ignore_errors=True)

    def strays(self) -> list[int]:
        """Live processes started by this Slurm (their environment names its config)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                environ = (proc / "environ").read_bytes()
            except OSError:
                continue
            if mark in environ.split(b"\0"):
                found.append(int(proc.name))
        return found

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)

    def __call__(self, *argv: str) -> str:
        done = self.run(*argv)
        assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
        return done.stdout

    def nodes(self) -> dict[str, SlurmNode]:
        done = self.run("sinfo", "--noheader", "--Node", "--format=%N|%T|%E")
        return parse_nodes(done.stdout) if done.returncode == 0 else {}

    def completions(self, job_id: str) -> list[tuple[str, str]]:
        """``sacct -c`` (the job completion log, no accounting database): each run of
        ``job_id`` that ended, as (state, exit code)."""
        out = self("sacct", "-c", "-X", "-n", "-P", "-j", job_id, "--format=State,ExitCode")
        return [(state, code) for state, code in (line.split("|") for line in out.splitlines())]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as key → value (values without spaces)."""
        out = self("scontrol", "show", "job", "--oneliner", job_id)
        return dict(f.split("=", 1) for f in out.split() if "=" in f)


@contextmanager
def slurm(directory: Path, nodes: list[str]) -> Iterator[Slurm]:
    if why := unavailable():
        pytest.skip(why)
    cluster = Slurm(directory, nodes)
    try:
        yield cluster  # started by the test once its cluster is up
    finally:
        cluster.stop()
