"""The operator's view for end-to-end tests: coordinatorctl run as a real subprocess
against a local cluster directory, with the waits every scenario needs.

With ``RINGMASTER_TEST_NETNS=1`` every ``up`` of these scenarios is ``up --netns``: each
node a host of its own on the control and data bridges (root only; skipped, saying why,
where namespaces cannot be made)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
from nats.errors import Error as NatsError

from coordinator.ctl import netns as ns
from coordinator.ctl.bus import Session, session
from coordinator.ctl.errors import CtlError
from coordinator.ctl.home import agent_run_dirs, resolve, resolve_creds
from coordinator.ctl.status import status_json
from coordinator.ctl.tail import Filters
from coordinator.ctl.tail import events as tail_events
from proto.events import Severity
from ringmaster.procs import wait_until
from ringmaster.rundir import live_ranks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
Status = dict[str, Any]
ENDED = ("failed", "stopped", "completed")
EVERY_UP_NAMESPACED = os.environ.get("RINGMASTER_TEST_NETNS") == "1"
T = TypeVar("T")


def eventually(
    predicate: Callable[[], T | None], timeout: float, failure: Callable[[], str], interval: float
) -> T:
    """``predicate``'s first truthy result; an AssertionError saying ``failure()`` if none
    comes within ``timeout`` s."""
    try:
        return wait_until(predicate, timeout, interval)
    except TimeoutError:
        raise AssertionError(failure()) from None


def described(predicate: Callable[..., object]) -> str:
    """A wait's predicate in words: its source line (a lambda's body), else its name."""
    try:
        source = " ".join(inspect.getsource(predicate).split())
    except (OSError, TypeError):
        return getattr(predicate, "__name__", repr(predicate))
    body = source.split("lambda", 1)[-1].split(":", 1)[-1].strip() if "lambda" in source else source
    return body.rstrip(",)") or source


def netns_unavailable() -> str:
    """Why ``up --netns`` cannot run here ("" when it can): it needs root and a kernel
    that lets this process make network namespaces (a container may not)."""
    if os.geteuid() != 0:
        return "up --netns needs root (network namespaces and bridges)"
    probe = f"rmprobe-{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    except FileNotFoundError:
        return "up --netns needs iproute2's ip command"
    if made.returncode != 0:
        return f"network namespaces unavailable here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return ""


def worker_networks() -> tuple[str, ...]:
    """Control and data networks of this test worker's own, and free on this machine: two
    namespaced clusters up at once on the same networks would give the host one address on
    two bridges, and so would one some earlier run left behind (``up`` refuses those)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return ()
    third = 16 + 2 * int(worker[2:])

    def pair(third: int) -> tuple[str, str]:
        return f"198.18.{third}.0/24", f"198.18.{third + 1}.0/24"

    while ns.in_use(*pair(third)) and third < 96:
        third += 8  # past every worker's first pair: never another worker's
    ctl_net, data_net = pair(third)
    return ("--ctl-net", ctl_net, "--data-net", data_net)


def host_address(home: Path) -> str:
    """Where a service of the test itself (a webhook, say) must listen for the cluster in
    ``home`` to reach it: loopback, or the host's address on a namespaced cluster's
    control bridge (the coordinators' namespace has no way to the host's loopback)."""
    net = ns.read(home)
    return net.host_addr if net is not None else "127.0.0.1"


def daemon_addresses(home: Path, network: str = "ctl") -> set[str]:
    """The addresses the cluster in ``home`` puts its daemons on: loopback, or with
    ``up --netns`` each node's address on the control (``ctl``) or data (``data``)
    network, and the coordinators' on the control network."""
    net = ns.read(home)
    if net is None:
        return {"127.0.0.1"}
    if network == "data":
        return {n.data_addr for n in net.nodes.values()}
    return {n.ctl_addr for n in [*net.nodes.values(), net.coordinators]}


# Spare interpreters as the agents keep them by default (two a simulated node), unless a
# scenario says otherwise (``ctl.env[WARM] = "1"`` before ``up``) or the environment does
# (``RINGMASTER_WARM_RANKS=0``: every rank starts cold). They are forks of the one
# template ``up`` starts for the whole cluster, which imports torch and DeepSpeed once per
# ``up`` (about 4.5 CPU-s), where each rank started cold imports them for itself: a warm
# start costs a few tenths of a CPU-second, so a scenario of a few restarts is cheaper with
# them than without, and its ranks start the way production's do.
WARM = "RINGMASTER_WARM_RANKS"


class Ctl:
    def __init__(self, home: Path, **env: str) -> None:
        self.home = home
        self.env = {**os.environ, "RINGMASTER_HOME": str(home), **env}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        if EVERY_UP_NAMESPACED and args[:1] == ("up",) and "--netns" not in args:
            if why := netns_unavailable():
                pytest.skip(f"RINGMASTER_TEST_NETNS=1: {why}")
            args = ("up", "--netns", *args[1:])
        if args[:1] == ("up",) and "--netns" in args and "--ctl-net" not in args:
            args = (*args, *worker_networks())
        return subprocess.run(
            [sys.executable, "-m", "coordinator.ctl.main", *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=300,
            check=False,
        )

    def __call__(self, *args: str) -> str:
        done = self.run(*args)
        assert done.returncode == 0, f"coordinatorctl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def status(self, job: str | None = None, retries: int = 20) -> Status:
        """``status --json``; a transient bus error (a server failing over) is retried,
        and must itself be one line."""
        for _ in range(retries):
            done = self.run("status", *([job] if job else []), "--json")
            if done.returncode == 0:
                result: Status = json.loads(done.stdout)
                return result
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
            time.sleep(0.5)
        raise AssertionError(done.stderr)

    def view(self, job: str | None, retries: int = 20) -> Status:
        """What ``status JOB --json`` prints, read the same way in this process: a wait
        polls several times a second, and a ``coordinatorctl`` process per poll would
        keep most of a core busy beside the cluster under test."""

        async def read(s: Session) -> Status:
            data: Status = json.loads(json.dumps(await status_json(s, job)))
            return data

        return self._in_process(read, f"status {job}", retries)

    def _in_process(self, read: Callable[[Session], Awaitable[T]], what: str, retries: int) -> T:
        """``read`` on a session of this cluster's, as ``coordinatorctl`` would open it;
        a transient bus error (a server failing over) is retried."""
        url, cluster = resolve(self.env.get("RINGMASTER_NATS"), None, str(self.home))
        creds = resolve_creds(self.env.get("RINGMASTER_CREDS"), str(self.home))

        async def run() -> T:
            async with session(url, cluster, creds) as s:
                return await read(s)

        for _ in range(retries):
            try:
                return asyncio.run(run())
            except (CtlError, NatsError, OSError) as exc:
                error = exc
                time.sleep(0.5)
        raise AssertionError(f"{what}: {error}")

    def wait(self, job: str, pred: Callable[[Status], bool], timeout: float = 200) -> Status:
        """The job's status once ``pred`` holds; fails at once if the job ends otherwise.
        A failure says what was awaited (``pred``'s source), for how long, and the status
        seen last; the scenario's report adds the cluster's recent events (conftest)."""
        last: Status = {}
        awaited = described(pred)

        def reached() -> Status | None:
            nonlocal last
            last = self.view(job)
            if pred(last):
                return last
            if last["state"] in ENDED:
                raise AssertionError(
                    f"job {job} ended {last['state']} ({last.get('reason')}) while waiting "
                    f"for {awaited}"
                )
            return None

        return eventually(
            reached,
            timeout,
            lambda: f"job {job}: {awaited} did not hold within {timeout:g} s; last status {last}",
            0.25,
        )

    def ranks(self, job: str) -> list[int]:
        """The PIDs of the job's running ranks on every node of this local cluster."""
        return [r.pid for d in agent_run_dirs(self.home) for r in live_ranks(d) if r.job == job]

    def events(self, *filters: str) -> list[Status]:
        """What ``tail --no-follow --json *filters`` prints (``--job``, ``--node``,
        ``--kind``, ``--severity``), read the same way in this process: scenarios poll it
        twice a second, and a ``coordinatorctl`` process per poll is half a CPU-second
        (``tail_via_cli`` runs the command itself)."""
        pairs = dict(zip(filters[::2], filters[1::2], strict=True))
        unknown = set(pairs) - {"--job", "--node", "--kind", "--severity"}
        assert not unknown, f"events(): no filter {unknown}"
        severity = pairs.get("--severity")
        wanted = Filters(
            node=pairs.get("--node"),
            job=pairs.get("--job"),
            kind=pairs.get("--kind"),
            severity=Severity(severity) if severity else None,
        )

        async def read(s: Session) -> list[Status]:
            found = [e async for e in tail_events(s, wanted, None, follow=False)]
            return [json.loads(json.dumps(msgspec.to_builtins(e))) for e in found]

        return self._in_process(read, f"events {filters}", 20)

    def tail_via_cli(self, *filters: str) -> list[Status]:
        out = self("tail", "--no-follow", "--json", *filters)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def start(self, job_file: str = "tiny.toml", *overrides: str) -> str:
        sets = [arg for item in overrides for arg in ("--set", item)]
        return self("start", str(EXAMPLES / job_file), *sets).strip()


def restarted(ctl: Ctl, job: str, count: int) -> Status:
    """The job's ``count``-th ``job.restarted`` event, waiting up to two minutes for it."""

    def found() -> Status | None:
        events = [e for e in ctl.events("--job", job) if e["kind"] == "job.restarted"]
        return events[count - 1] if len(events) >= count else None

    return eventually(
        found, 120, lambda: f"no restart #{count} of {job} within 120 s; {said(ctl, job)}", 0.5
    )


def first_event(ctl: Ctl, job: str, kind: str, after: float = 0.0, timeout: float = 120) -> Status:
    """The job's first event of ``kind`` later than ``after`` (event time, Unix seconds)."""

    def found() -> Status | None:
        for e in ctl.events("--job", job):
            if e["kind"] == kind and _seconds(e["time"]) > after:
                return e
        return None

    return eventually(
        found,
        timeout,
        lambda: f"no {kind} of {job} after {after} within {timeout:g} s; {said(ctl, job)}",
        0.5,
    )


def said(ctl: Ctl, job: str, last: int = 12) -> str:
    """The job's newest events, kind and message: what a failed wait saw instead."""
    events = ctl.events("--job", job)[-last:]
    return "its last events: " + "; ".join(f"{e['kind']}: {e.get('message', '')}" for e in events)


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()
