"""A chaos soak: one job on a local cluster, a random fault every few seconds, for minutes.

    .venv/bin/python bench/soak.py --minutes M --every S --seed N [--json OUT] [--dir DIR]

``coordinatorctl up --nodes 5 --standby`` (a leader and a standby coordinator) in DIR (a
temporary directory, removed at the end, unless ``--dir``), one 2-node
``examples/tiny.toml`` job with ``job.spares=1`` and ``job.min_nodes=1`` (it may shrink),
enough steps to train the whole soak. Once it trains, a fault every S seconds, drawn by
the seed from the whole mix (``bench/soak_plan.py``): rank kill, node loss (the node back
25 s later), hang, straggler, spot notice, NVMe latency spike, clock offset, non-finite
loss, leader ``kill -9`` (started again as a standby), a 12 s bus freeze (nats-server
SIGSTOP, then SIGCONT) and an agent restart followed 10 s later by a rank kill on its
node. Node faults hit one of the job's current nodes (``status --json JOB``).

A lost node is repaired with ``inject NODE restart-agent``, which starts a dead agent
again as it was last started (the node's simulator is the cluster's one, and lives on);
nothing in ``inject`` kills or starts a coordinator, so the leader is killed by its PID
and started again with the command line ``up`` gave it (read from ``/proc`` first).

Per fault, one line: when, what, where, the job's reaction (the ``job.*`` kinds in the
event stream until the next fault) and the seconds back to training (the ranks' own log
lines: the first step of an attempt started after the fault, else the first step after
it). At the end: the job's state, its restarts around each fault, the goodput ledger,
the productive share of GPU time and the longest stretch without a step while the job
was neither paused nor waiting for nodes. Exit 1 if the job failed or was stuck (such a
stretch over 30 s). Everything is brought down at the end, on Ctrl-C and on error too.
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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_harness import TINY, Ctl, read_records, wait_for
from bench.soak_plan import (
    BENCH_ACTIONS,
    CLUSTER_FAULTS,
    STUCK_S,
    Planned,
    actions,
    back_to_training,
    longest_stall,
    parser,
    reaction,
    schedule,
    target,
)
from bench.soak_watch import Events, Sampler, leftovers
from coordinator.ctl.home import pid_file
from coordinator.ctl.local import _spawn
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
        _spawn(ctx["target"], ctx["argv"], self.ctl.home)
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
        at = time.time()
        said = self.act(first, ctx) if node else "not done: the job has no nodes"
        return {
            "fault": p.fault,
            "action": first,
            "at_s": p.at,
            "wall": at,
            "target": ctx["target"],
            "said": said,
            "restarts_before": record.get("restarts"),
            "ctx": ctx,
        }

    def close(self, fault: dict[str, Any], until: float) -> None:
        """What followed a fault until ``until`` (the next fault, or the end)."""
        at = fault["wall"]
        window = self.events.between(at, until)
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
            events=[
                [round(e["at"] - at, 1), e["kind"], e.get("node") or e.get("job")] for e in window
            ],
            back_s=back,
            until=until,
            restarts_after=restarts_after,
            restarted=restarted,
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

    def run(self, plan: list[Planned], minutes: float) -> tuple[list[dict[str, Any]], float]:
        """Faults and their follow-ups in time order, from one queue; a follow-up (a node
        brought back, the bus thawed) is carried out even once the job has ended."""
        t0 = time.time()
        order = itertools.count()  # ties in time go in the order queued
        queue: list[tuple[float, int, Planned | str, dict[str, Any]]] = [
            (t0 + p.at, next(order), p, {}) for p in plan
        ]
        heapq.heapify(queue)
        done: list[dict[str, Any]] = []
        ended = False
        while queue:
            when, _, what, ctx = heapq.heappop(queue)
            time.sleep(max(0.0, when - time.time()))
            if isinstance(what, str):
                then = f"then {what}: {self.act(what, ctx)}"
                if "closed" in ctx:  # after its fault's line: a line of its own
                    print(f"{time.time() - t0:7.0f} s  ... {ctx['target']}: {then}", flush=True)
                ctx.setdefault("then", []).append(then)
                continue
            if done:
                self.close(done[-1], time.time())
            ended = ended or self.sampler.latest().get("state") in ("completed", "failed")
            if ended:
                continue
            done.append(self.inject(what))
            for delay, action in actions(what)[1]:
                heapq.heappush(
                    queue, (done[-1]["wall"] + delay, next(order), action, done[-1]["ctx"])
                )
        time.sleep(max(0.0, t0 + minutes * 60 - time.time()))
        if done and "closed" not in done[-1]["ctx"]:
            self.close(done[-1], time.time())
        for fault in done:
            fault.pop("ctx")
        return done, t0


def report(soak: Soak, faults: list[dict[str, Any]], t0: float, args: Any) -> dict[str, Any]:
    final = soak.ctl.status(soak.job)
    goodput: dict[str, float] = final["goodput"]
    total = sum(goodput.values())
    steps = [r.wall for r in read_records(soak.ctl.logs(soak.job)) if r.event == "step"]
    stall, began = longest_stall(steps, soak.sampler.excused(), t0, time.time())
    out = {
        "settings": {"minutes": args.minutes, "every": args.every, "seed": args.seed},
        "job": {k: final.get(k) for k in ("id", "state", "step", "restarts", "reason")},
        "faults": faults,
        "goodput": goodput,
        "productive_share": round(goodput.get("productive", 0.0) / total, 3) if total else None,
        "longest_stall_s": stall,
        "longest_stall_at_s": round(began - t0, 1),
    }
    out["stuck"] = stall > STUCK_S
    print(f"\njob {final['state']} at step {final['step']}, restarts {final['restarts']}")
    if final.get("reason"):
        print(f"  reason: {final['reason']}")
    for f in faults:  # the attempts that came after the next fault count too
        f["back_s"] = soak.back(f, f.pop("until"), f["restarted"])
        back = "never" if f["back_s"] is None else f"{f['back_s']:.1f} s"
        print(
            f"  {f['at_s']:5.0f} s {f['fault']:13} restarts {f['restarts_before']}→"
            f"{f['restarts_after']}, back to training {back}"
        )
    print("goodput (GPU-s): " + ", ".join(f"{k} {v:.1f}" for k, v in goodput.items()))
    share = out["productive_share"]
    print(f"productive share: {'-' if share is None else f'{100 * share:.1f} %'}")
    print(
        f"longest stretch without a step (not paused, not waiting for nodes): {stall:.1f} s, "
        f"from {began - t0:.0f} s" + (" — stuck" if out["stuck"] else "")
    )
    return out


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
    home.mkdir(parents=True, exist_ok=True)
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
        faults, t0 = soak.run(plan, args.minutes)
        out = report(soak, faults, t0, args)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        return 1 if out["stuck"] or out["job"]["state"] == "failed" else 0
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
