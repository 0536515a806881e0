"""A chaos soak: one job on a local cluster, a random fault every few seconds, for minutes.

    .venv/bin/python bench/soak.py --minutes M --every S --seed N [--json OUT] [--dir DIR]

``coordinatorctl up --nodes 5 --standby`` (a leader and a standby coordinator) in DIR (a
temporary directory, removed at the end, unless ``--dir``), one 2-node
``examples/tiny.toml`` job with ``job.spares=1`` and ``job.min_nodes=1`` (it may shrink),
enough steps to train the whole soak. Once it trains, a fault every S seconds, drawn by
the seed from the whole mix (``bench/soak_plan.py``): rank kill, node loss (the node back
25 s later), hang, straggler, spot notice (withdrawn 10 s after its deadline), a spot
notice that passes (never withdrawn, the machine never taken), NVMe latency spike, clock
offset, non-finite loss, leader ``kill -9`` (started again as a standby), a 12 s bus
freeze (nats-server SIGSTOP, then SIGCONT) and an agent restart followed 10 s later by a
rank kill on its node. Node faults hit one of the job's current nodes (``status --json
JOB``).

A lost node is repaired with ``inject NODE restart-agent``, which starts a dead agent
again as it was last started (the node's simulator is the cluster's one, and lives on);
nothing in ``inject`` kills or starts a coordinator, so the leader is killed by its PID
and started again with the command line ``up`` gave it (read from ``/proc`` first).

Per fault, one line: when, what, where, the job's reaction (the ``job.*`` kinds in the
event stream until the next fault) and the seconds back to training (the ranks' own log
lines: the first step of an attempt started after the fault, else the first step after
it). At the end: the job's state, its restarts and rewinds, its restarts around each
fault, the goodput ledger, the productive share of GPU time and the longest stretch
without a step while the job was neither paused nor waiting for nodes; then, once every
live node is ready or held for a person (at most 180 s), every node's state and, for each
live one not ready, why. Exit 1 if the job failed or was stuck (such a stretch over 30 s)
or a live node was left neither ready nor held. Everything is brought down at the end,
on Ctrl-C and on error too.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_harness import TINY, Ctl, read_records, wait_for
from bench.soak_plan import (
    BENCH_ACTIONS,
    CLUSTER_FAULTS,
    SETTLE_S,
    Planned,
    actions,
    back_to_training,
    cost,
    parser,
    reaction,
    schedule,
    target,
)
from bench.soak_report import report
from bench.soak_watch import Events, Sampler, leftovers, settle
from coordinator.ctl.home import pid_file
from coordinator.ctl.spawn import spawn
from ringmaster.procs import read_pid

STEPS_PER_S = 50  # more than tiny trains on a CPU: the job outlasts the soak


def _argv(pid: int) -> list[str]:
    """The command line a process was started with, to start it again the same way."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


class Soak:
    def __init__(self, ctl: Ctl, job: str, sampler: Sampler, events: Events) -> None:
        self.ctl, self.job, self.sampler, self.events = ctl, job, sampler, events
        self.nodes: list[str] = []  # the job's nodes when last seen with any
        self.frozen: int | None = None  # the nats-server's PID while it is stopped
        self.record: dict[str, Any] = {}  # the job record read as the last fault closed
        self.done: list[dict[str, Any]] = []  # the faults injected so far
        self.queue: list[tuple[float, int, Planned | str, dict[str, Any]]] = []
        self.order = itertools.count()  # ties in time go in the order queued
        self.lock = threading.Lock()  # over the queue
        self.t0 = 0.0  # when the soak started

    def pid(self, name: str) -> int:
        """The PID ``up`` recorded for ``name``; never 0 or none (a signal to 0 would hit
        the soak's own process group)."""
        pid = read_pid(pid_file(self.ctl.home, name))
        if not pid:
            raise RuntimeError(f"no PID file for {name}")
        return pid

    def act(self, action: str, ctx: dict[str, Any]) -> str:
        """Carry out one action of a fault; what was done, or why not."""
        try:
            if action in BENCH_ACTIONS:
                return getattr(self, action.replace("-", "_"))(ctx)
            return self.inject_form(ctx["target"], action)
        except (RuntimeError, OSError) as exc:
            return f"not done: {exc}"

    def inject_form(self, node: str, form: str) -> str:
        """``inject NODE FORM``: what it said (on stderr), or a RuntimeError saying why not."""
        done = self.ctl.run("inject", node, form, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().removeprefix("coordinatorctl: "))
        return done.stderr.strip()

    def kill_leader(self, ctx: dict[str, Any]) -> str:
        leaders = [c["id"] for c in self.ctl.status()["coordinators"] if c["leader"]]
        if not leaders:
            return "not done: no coordinator leads"
        ctx["target"] = leaders[0]
        pid = self.pid(leaders[0])
        ctx["argv"] = _argv(pid)
        os.kill(pid, signal.SIGKILL)
        return f"killed {leaders[0]} (pid {pid})"

    def start_coordinator(self, ctx: dict[str, Any]) -> str:
        spawn(ctx["target"], ctx["argv"], self.ctl.home)
        return f"started {ctx['target']} again"

    def freeze_bus(self, ctx: dict[str, Any]) -> str:
        self.frozen = self.pid("nats-server")
        os.kill(self.frozen, signal.SIGSTOP)
        return f"stopped nats-server (pid {self.frozen})"

    def thaw_bus(self, ctx: dict[str, Any] | None = None) -> str:
        if self.frozen is None:
            return "the bus was not frozen"
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.frozen, signal.SIGCONT)
        self.frozen = None
        self.events.restart()  # its subscription does not outlive a frozen server
        return "continued nats-server"

    def inject(self, p: Planned) -> dict[str, Any]:
        record = self.record or self.sampler.latest()
        self.nodes = list(record.get("nodes") or self.nodes)
        node = CLUSTER_FAULTS.get(p.fault) or target(self.nodes, p.pick)
        first, _ = actions(p)
        ctx = {"target": node}
        sent = time.time()
        said = self.act(first, ctx) if node else "not done: the job has no nodes"
        # the fault's time is after: ``inject`` acts at the end of a call that may take
        # seconds to start; what it caused is looked for from when it was sent
        at = time.time()
        return {
            "fault": p.fault,
            "action": first,
            "at_s": round(at - self.t0, 1),
            "planned_s": p.at,
            "wall": at,
            "sent": sent,
            "target": ctx["target"],
            "said": said,
            "restarts_before": record.get("restarts"),
            "goodput_before": record.get("goodput"),
            "ctx": ctx,
        }

    def close(self, fault: dict[str, Any], until: float) -> None:
        """What followed a fault until ``until`` (the next fault, or the end)."""
        at = fault["wall"]
        window = self.events.between(fault["sent"], until)
        mine = [e["kind"] for e in window if e.get("job") == self.job]
        seen = {
            e["kind"]
            for e in window
            if not e["kind"].startswith("job.")
            and (e.get("node") == fault["target"] or e["kind"].startswith("coordinator."))
        }
        try:  # fresh: the sampler lags on a loaded machine
            self.record = self.ctl.status(self.job, tries=3)
        except RuntimeError:
            self.record = self.sampler.latest()
        restarts_after = self.record.get("restarts")
        restarted = (restarts_after or 0) > (fault["restarts_before"] or 0)
        restarted = restarted or bool({"job.recovering", "job.restarted"} & set(mine))
        back = self.back(fault, until, restarted)
        fault.update(
            reaction=reaction(mine),
            signals=sorted(seen),
            # each with its message, which says why (a recovery's reason, a rank's attempt
            # and exit status): what is left to find a cause by once the cluster is gone
            events=[
                [
                    round(e["at"] - at, 1),
                    e["kind"],
                    e.get("node") or e.get("job"),
                    e["message"],
                    {k: e[k] for k in ("rank", "attempt", "exit_code", "signal") if k in e},
                ]
                for e in window
            ],
            back_s=back,
            until=until,
            restarts_after=restarts_after,
            restarted=restarted,
            cost=cost(fault.pop("goodput_before"), self.record.get("goodput")),
            then=fault["ctx"].get("then", []),
        )
        fault["ctx"]["closed"] = True
        back_text = "no step yet" if back is None else f"{back:.1f} s"
        print(
            f"{fault['at_s']:7.0f} s  {fault['fault']:13} {fault['target'] or '-':13} "
            f"reaction {fault['reaction']:28} back {back_text:8} "
            f"restarts {fault['restarts_before']}→{fault['restarts_after']}  "
            f"({'; '.join([fault['said'], *fault['then']])}; "
            f"seen: {', '.join(fault['signals']) or '-'})",
            flush=True,
        )

    def back(self, fault: dict[str, Any], until: float, restarted: bool) -> float | None:
        records = read_records(self.ctl.logs(self.job))
        starts = [r.wall for r in records if r.event == "start"]
        steps = [r.wall for r in records if r.event == "step"]
        return back_to_training(starts, steps, fault["wall"], until, restarted)

    def follow_up(self, action: str, ctx: dict[str, Any]) -> None:
        then = f"then {action}: {self.act(action, ctx)}"
        if "closed" in ctx:  # after its fault's line: a line of its own
            print(f"{time.time() - self.t0:7.0f} s  ... {ctx['target']}: {then}", flush=True)
        ctx.setdefault("then", []).append(then)

    def fault(self, p: Planned) -> None:
        """Close the previous fault, then inject this one and queue its follow-ups; none
        once the job has ended."""
        if self.done:
            self.close(self.done[-1], time.time())
        if self.sampler.latest().get("state") in ("completed", "failed"):
            return
        fault = self.inject(p)
        self.done.append(fault)
        with self.lock:
            for delay, action in actions(p)[1]:
                heapq.heappush(self.queue, (fault["wall"] + delay, next(self.order), action, fault))

    def run(self, plan: list[Planned], minutes: float) -> list[dict[str, Any]]:
        """Each fault and follow-up at its time, from one queue: the faults one after
        another, each follow-up (a node repaired, the bus thawed) in a thread of its own,
        so that a slow ``coordinatorctl`` on a loaded machine delays no other; follow-ups
        are carried out even once the job has ended."""
        self.t0 = time.time()
        self.queue = [(self.t0 + p.at, next(self.order), p, {}) for p in plan]
        heapq.heapify(self.queue)
        running: list[Future[None]] = []
        with ThreadPoolExecutor(1) as faults, ThreadPoolExecutor(4) as follow_ups:
            while self.queue or not all(f.done() for f in running):
                with self.lock:
                    due = self.queue and self.queue[0][0] <= time.time()
                    item = heapq.heappop(self.queue) if due else None
                if item is None:
                    time.sleep(0.2)
                elif isinstance(item[2], Planned):
                    running.append(faults.submit(self.fault, item[2]))
                else:
                    running.append(follow_ups.submit(self.follow_up, item[2], item[3]["ctx"]))
        for done in running:
            done.result()  # what went wrong in a thread is raised here
        time.sleep(max(0.0, self.t0 + minutes * 60 - time.time()))
        if self.done and "closed" not in self.done[-1]["ctx"]:
            self.close(self.done[-1], time.time())
        for fault in self.done:
            fault.pop("ctx")
        return self.done


def first_step(ctl: Ctl, job: str) -> dict[str, Any]:
    def trained() -> dict[str, Any] | None:
        s = ctl.status(job)
        if s["state"] in ("failed", "stopped", "completed"):
            raise RuntimeError(f"the job {job} ended {s['state']} before the soak: {s['reason']}")
        return s if s["step"] >= 1 else None

    found = wait_for(trained, 600, 1.0)
    if found is None:
        raise RuntimeError(f"the job {job} did not train within 600 s")
    return found


def main() -> int:
    args = parser().parse_args()
    home = Path(args.dir).resolve() if args.dir else Path(tempfile.mkdtemp(prefix="soak-"))
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser().error(f"--dir {home}: {exc.strerror}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    ctl = Ctl(home, home)
    events = Events(ctl)
    soak: Soak | None = None
    try:
        print(f"cluster in {home}: up --nodes 5 --standby", file=sys.stderr)
        ctl("up", "--nodes", "5", "--standby")
        events.start()
        steps = max(10_000, int(STEPS_PER_S * args.minutes * 60))
        sets: dict[str, object] = {"job.spares": 1, "job.min_nodes": 1, "train.steps": steps}
        sets["checkpoint.dir"] = home / "checkpoints"
        argv = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
        job = ctl("start", str(TINY), *argv, "--fresh").strip()
        sampler = Sampler(ctl, job)
        sampler.samples.append((time.time(), first_step(ctl, job)))
        sampler.start()
        soak = Soak(ctl, job, sampler, events)
        plan = schedule(args.minutes, args.every, args.seed)
        print(f"job {job} trains; {len(plan)} faults", flush=True)
        faults = soak.run(plan, args.minutes)
        nodes, waited = settle(ctl, SETTLE_S)
        out = report(soak, faults, args, nodes, waited)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        return 1 if out["stuck"] or out["unsettled"] or out["job"]["state"] == "failed" else 0
    except KeyboardInterrupt:
        print("interrupted: bringing the cluster down", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    finally:
        if soak is not None:
            soak.sampler.done.set()
            soak.thaw_bus()
        events.stop()
        ctl("down", check=False, timeout=300)
        if left := leftovers(home):
            print(f"soak: still running after down: {', '.join(left)}", file=sys.stderr)
        if not args.dir:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
