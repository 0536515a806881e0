"""Recovery time per fault class, Ringmaster against torchrun elastic, in the same run.

    .venv/bin/python bench/recovery.py [--steps 3000] [--only ringmaster|torchrun]
        [--memory both|on|off] [--first on|off] [--no-baseline] [--cap 150] [--json OUT.json]
        [--workload builtin|hf]

Ringmaster: ``coordinatorctl up --nodes 4``, one 2-rank ``examples/tiny.toml`` job
(checkpoint every 100 steps, ``job.min_nodes=1``, default policy), and the faults one after
another on the same job, each once the job has trained 30 steps since the last:
``kill-worker`` on the second node, ``lose-node`` on the second node, ``lose-node`` on the
rendezvous master's node, ``hang`` (SIGSTOP) of a rank, ``spot-notice=20`` (``--faults``
picks them, in its order; a fault named again is repeated, with a row of its own). Then the job
must complete; its final loss is printed beside an uninterrupted run's from the same seed.
``--memory both`` (the default) runs that job twice, with the memory tier on and off
(``checkpoint.memory_tier=false``), for the two columns of the same run; ``--first``
says which half runs first, so that a machine busier in one half can be told apart from
the tier's own cost by running both orders.

torchrun: two ``torchrun --nnodes=1:2 --rdzv-backend=c10d`` agents on this machine (one
rank each, the first hosts the rendezvous store: the "master node"), the same trainer and
job file, ``--max-restarts 10``; each fault on a fresh pair, since some leave nothing to
recover. A spot notice means nothing to torchrun: the node vanishes at its deadline (20 s).

``--workload hf``: the same, with a user's own Hugging Face ``Trainer`` script
(``examples/hf_trainer.py``, ``save_steps=200``) instead of the built-in trainer: under
Ringmaster with its two-line callback (``examples/hf_trainer.toml``); under torchrun as its
users run it today, the script without those lines (it resumes from its own newest
checkpoint), timed by ``bench/hf_steps.py``, a stopwatch callback that changes nothing.

For every fault: seconds from the fault to the first training step of the attempt after
it (from the ranks' own log lines, ``wall=`` Unix time), and the steps redone (the newest
step logged before that attempt started minus the step it resumed from); with the memory
tier, also the spacing of its snapshots the ranks had set by the fault (their last
``memory_tier`` line), which bounds the steps a fault may cost. ``--cap`` seconds without
a step counts as not recovered.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_harness import (
    REPO,
    TINY,
    Ctl,
    Record,
    newest_step,
    read_records,
    recovered,
    wait_for,
)

FAULTS = ("rank killed", "node lost", "master node lost", "rank stopped", "spot notice 20 s")
INJECT = {  # fault → (which of the job's nodes, the inject form)
    "rank killed": (1, "kill-worker"),
    "node lost": (1, "lose-node"),
    "master node lost": (0, "lose-node"),
    "rank stopped": (1, "hang"),
    "spot notice 20 s": (0, "spot-notice=20"),
}
GAP_S = 15.0  # seconds of training between one fault's recovery and the next fault
HF_SCRIPT = REPO / "examples" / "hf_trainer.py"
HF_JOB = REPO / "examples" / "hf_trainer.toml"
HF_SAVE_STEPS = 200  # the script's own checkpoint cadence, as its users set it


def hf_entry(out: Path, steps: int) -> str:
    """``job.entry`` for the Hugging Face script writing into ``out``."""
    argv = ["hf_trainer.py", "--out", str(out), "--steps", str(steps)]
    return "job.entry=" + json.dumps([*argv, "--save-steps", str(HF_SAVE_STEPS)])


def unmodified_hf(into: Path) -> Path:
    """The Hugging Face script without its integration lines: its users' own."""
    lines = HF_SCRIPT.read_text().splitlines()
    into.write_text("\n".join(x for x in lines if not x.rstrip().endswith("# ringmaster")))
    return into


@dataclass
class Result:
    fault: str
    seconds: float | None  # None: no step within the cap
    redone: int | None
    note: str = ""
    every: int | None = None  # the memory tier's cadence the ranks had set by the fault
    # from the first rank process started after the fault to the first step: the part of
    # the recovery a restore (memory or durable) is in
    started_to_step: float | None = None
    inject_s: float | None = None  # how long the inject command took (the fault is in it)
    to_started: float | None = None  # from the fault to the first new rank process
    restore_s: float | None = None  # the slowest new rank's resume (memory or durable load)


def cadence_at(records: list[Record], before: float) -> int | None:
    """The memory tier's spacing in steps that the ranks' last ``memory_tier`` line
    before ``before`` set (None: no tier, or none logged yet)."""
    set_by = [r for r in records if r.event == "memory_tier" and r.wall <= before]
    every = set_by[-1].fields.get("every_steps") if set_by else None
    return int(every) if every is not None else None


def measure(logs: Callable[[], list[Path]], fault_at: float, cap: float, note: str = "") -> Result:
    found = wait_for(lambda: recovered(read_records(logs()), fault_at), cap, 0.1)
    if found is None:
        return Result("", None, None, note or f"no training step within {cap:g} s")
    wall, started, resumed = found
    # every step trained before the next attempt started (after a notice, the ranks train
    # on until they stop) and not carried over by its checkpoint is redone
    records = read_records(logs())
    before = newest_step(records, started)
    every = cadence_at(records, fault_at)
    began = next((r.wall for r in records if r.event == "started" and r.wall > fault_at), None)
    started_to_step = round(wall - began, 2) if began is not None else None
    redone = max(0, before - resumed)
    result = Result("", round(wall - fault_at, 2), redone, note, every, started_to_step)
    result.to_started = round(began - fault_at, 2) if began is not None else None
    result.restore_s = restore_took(records, fault_at, wall)
    return result


def restore_took(records: list[Record], after: float, before: float) -> float | None:
    """The slowest rank's resume (its ``took_s``) between ``after`` and ``before``: every
    rank must have resumed before any steps."""
    took = [
        float(r.fields["took_s"])
        for r in records
        if r.event in ("resumed_from", "fresh_start") and after < r.wall <= before
        if "took_s" in r.fields
    ]
    return max(took) if took else None


# -- Ringmaster ------------------------------------------------------------------------


def _trained(ctl: Ctl, job: str, step: int, timeout: float) -> dict | None:  # type: ignore[type-arg]
    def ready() -> dict | None:  # type: ignore[type-arg]
        s = ctl.status(job)
        return s if s["state"] == "running" and (s["step"] or 0) >= step else None

    return wait_for(ready, timeout, 0.3)


def ringmaster(
    steps: int,
    cap: float,
    gap: float,
    root: Path,
    memory: bool,
    baseline: bool,
    faults: tuple[str, ...] | list[str] = FAULTS,
    workload: str = "builtin",
) -> tuple[list[Result], dict[str, object]]:
    root.mkdir(parents=True, exist_ok=True)
    ctl = Ctl(root / "cluster", root)
    sets = ["--set", f"train.steps={steps}", "--set", "checkpoint.every_steps=100"]
    sets += ["--set", f"checkpoint.memory_tier={'true' if memory else 'false'}"]
    job_file = TINY
    if workload == "hf":
        job_file, baseline = HF_JOB, False  # the script's loss is its own business
        sets += ["--set", hf_entry(root / "hf-out", steps)]
    ctl("up", "--nodes", "4")
    results: list[Result] = []
    try:
        job = ctl("start", str(job_file), *sets, "--set", "job.min_nodes=1").strip()
        done_at = 0
        for fault in faults:
            if _trained(ctl, job, done_at + 1, cap * 2) is None:
                results.append(Result(fault, None, None, "the job did not train again"))
                break
            time.sleep(gap)
            status = ctl.status(job)
            index, form = INJECT[fault]
            node = status["nodes"][min(index, len(status["nodes"]) - 1)]
            fault_at = time.time()
            ctl("inject", node, form)
            inject_s = time.time() - fault_at
            result = measure(lambda: ctl.logs(job), fault_at, cap)
            result.inject_s = round(inject_s, 2)
            result.fault, result.note = fault, f"{form} on {node}; " + result.note
            if (n := sum(r.fault.split(" #")[0] == fault for r in results)) > 0:
                result.fault = f"{fault} #{n + 1}"  # a repeated fault gets a row of its own
            results.append(result)
            done_at = ctl.status(job)["step"] or 0
            print(f"  {fault}: {result}", file=sys.stderr)
        final = wait_for(
            lambda: s if (s := ctl.status(job))["state"] in ("completed", "failed") else None,
            600,
            1.0,
        )
        if not baseline:
            return results, {"job": final, "faulted_loss": (final or {}).get("loss")}
        # the uninterrupted run gets a cluster of its own: the faults left this one short
        ctl("down")
        ctl("up", "--nodes", "2")
        baseline = ctl("start", str(TINY), *sets, "--fresh").strip()
        plain = wait_for(
            lambda: s if (s := ctl.status(baseline))["state"] in ("completed", "failed") else None,
            900,
            1.0,
        )
        summary = {
            "job": final,
            "uninterrupted_loss": (plain or {}).get("loss"),
            "faulted_loss": (final or {}).get("loss"),
        }
        return results, summary
    finally:
        ctl("down", check=False)


# -- torchrun elastic ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _worker(agent: subprocess.Popen[bytes]) -> int | None:
    """The trainer process under a torchrun agent."""
    for child in _children(agent.pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"trainer.worker" in cmdline or b"hf_steps.py" in cmdline:
                return child
        except OSError:
            continue
    return None


def _lose(agent: subprocess.Popen[bytes]) -> None:
    """The machine dies: the agent and its workers (each in a session of its own) at once."""
    for pid in (*_children(agent.pid), agent.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def torchrun_trial(
    fault: str, steps: int, cap: float, gap: float, root: Path, workload: str = "builtin"
) -> Result:
    work = root / re.sub(r"\W+", "-", fault)
    work.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    logs = [work / f"agent-{i}.log" for i in range(2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RINGMASTER_WORKDIR": str(work)}
    env["PYTHONPATH"] = str(REPO)
    worker = ["-m", "trainer.worker", "--config", str(work / "job.toml")]
    if workload == "hf":
        script = str(unmodified_hf(work / "hf_trainer.py"))
        worker = [str(REPO / "bench" / "hf_steps.py"), script, "--out", str(work / "out")]
        worker += ["--steps", str(steps), "--save-steps", str(HF_SAVE_STEPS)]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=bench",
        "--max-restarts=10",
        "--monitor-interval=0.5",
        *worker,
    ]
    text = TINY.read_text().replace("steps = 200", f"steps = {steps}")
    text = text.replace("every_steps = 50", "every_steps = 100")
    (work / "job.toml").write_text(text)
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for log in logs:
            with log.open("wb") as out:
                agents.append(
                    subprocess.Popen(
                        argv, cwd=work, env=env, stdout=out, stderr=out, start_new_session=True
                    )
                )
            time.sleep(1.0)  # the first agent hosts the rendezvous store
        if not wait_for(lambda: newest_step(read_records(logs), time.time()) or None, 300, 0.5):
            return Result(fault, None, None, "torchrun never trained")
        time.sleep(gap)
        fault_at = time.time()
        note = ""
        match fault:
            case "rank killed":
                os.kill(_worker(agents[1]) or agents[1].pid, signal.SIGKILL)
            case "node lost":
                _lose(agents[1])
            case "master node lost":
                _lose(agents[0])
            case "rank stopped":
                os.kill(_worker(agents[1]) or agents[1].pid, signal.SIGSTOP)
            case _:
                time.sleep(20.0)  # nobody listens to the notice: the node vanishes
                _lose(agents[1])
                note = "node killed at the deadline"
        result = measure(lambda: logs, fault_at, cap, note)
        result.fault = fault
        return result
    finally:
        for agent in agents:
            for pid in _children(agent.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGCONT)
            _lose(agent)
            agent.wait()


# -- report -------------------------------------------------------------------------------


def _cell(r: Result | None) -> str:
    if r is None:
        return "—"
    if r.seconds is None:
        return "never"
    every = f", snapshots every {r.every}" if r.every is not None else ""
    return f"{r.seconds:.1f} s ({r.redone} redone{every})"


def _restart_cell(r: Result | None) -> str:
    """Where the seconds went: fault → new ranks started, started → first step (of it,
    the slowest rank's resume)."""
    if r is None or r.started_to_step is None:
        return "—"
    head = f"{r.to_started:.2f} + " if r.to_started is not None else ""
    resume = f" (resume {r.restore_s:.2f})" if r.restore_s is not None else ""
    return f"{head}{r.started_to_step:.2f} s{resume}"


def table(
    columns: dict[str, list[Result]],
    cell: Callable[[Result | None], str] = _cell,
    ratio: bool = True,
) -> str:
    """One row per fault, one column per run, each cell by ``cell``; with ``ratio``, the
    ratio of the last column's seconds (torchrun, when run) to the first's."""
    by = {name: {r.fault: r for r in results} for name, results in columns.items() if results}
    names = list(by)
    head = [*names, "ratio"] if ratio else names
    rows = ["| fault | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    faults = dict.fromkeys(r.fault for results in columns.values() for r in results)
    for fault in faults:
        cells = [by[n].get(fault) for n in names]
        row = [cell(c) for c in cells]
        if ratio:
            a, b = cells[0], cells[-1]
            row.append("—")
            if len(cells) > 1 and a and b and a.seconds and b.seconds:
                row[-1] = f"{b.seconds / a.seconds:.1f}×"
            elif len(cells) > 1 and a and a.seconds and b and b.seconds is None:
                row[-1] = f"∞ ({names[-1]} never recovers)"
        rows.append(f"| {fault} | " + " | ".join(row) + " |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--only", choices=("ringmaster", "torchrun"))
    parser.add_argument("--cap", type=float, default=150.0)
    parser.add_argument("--gap", type=float, default=GAP_S)
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--memory", choices=("both", "on", "off"), default="both")
    parser.add_argument(
        "--first", choices=("on", "off"), default="on", help="with --memory both: which runs first"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the uninterrupted run")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--workload",
        choices=("builtin", "hf"),
        default="builtin",
        help="the built-in trainer, or a user's Hugging Face Trainer script",
    )
    args = parser.parse_args()
    runs: dict[str, list[Result]] = {}
    summaries: dict[str, dict[str, object]] = {}
    both = (True, False) if args.first == "on" else (False, True)
    tiers = {"both": both, "on": (True,), "off": (False,)}[args.memory]
    with tempfile.TemporaryDirectory(prefix="ringmaster-recovery-") as tmp:
        root = Path(tmp)
        if args.only != "torchrun":
            for i, memory in enumerate(tiers):
                name = f"Ringmaster, memory tier {'on' if memory else 'off'}"
                print(f"{name}: one job, the faults one after another", file=sys.stderr)
                baseline = i == 0 and not args.no_baseline
                work = root / f"ringmaster-{'on' if memory else 'off'}"
                runs[name], summaries[name] = ringmaster(
                    args.steps,
                    args.cap,
                    args.gap,
                    work,
                    memory,
                    baseline,
                    args.faults,
                    args.workload,
                )
        if args.only != "ringmaster":
            print("torchrun elastic: a fresh pair of agents per fault", file=sys.stderr)
            theirs = runs.setdefault("torchrun elastic", [])
            for fault in args.faults:
                theirs.append(
                    torchrun_trial(
                        fault, args.steps, args.cap, args.gap, root / "torchrun", args.workload
                    )
                )
                print(f"  {fault}: {theirs[-1]}", file=sys.stderr)
    print(table(runs))
    print(
        "\nFault → first new rank process + from it to the first step "
        "(of which the slowest rank's resume):"
    )
    print(table(runs, _restart_cell, ratio=False))
    for name, summary in summaries.items():
        job = summary.get("job") or {}
        assert isinstance(job, dict)
        plain = summary.get("uninterrupted_loss")
        print(
            f"\n{name}: job {job.get('state')} at step {job.get('step')}, restarts "
            f"{job.get('restarts')}; final loss {summary['faulted_loss']}"
            + (f" vs {plain} uninterrupted" if plain is not None else "")
        )
        seconds = [r.seconds for r in runs[name] if r.seconds is not None]
        if seconds:
            print(f"median {statistics.median(seconds):.1f} s, worst {max(seconds):.1f} s")
        after = [r.seconds - r.inject_s for r in runs[name] if r.seconds and r.inject_s]
        if after:
            print(
                "from the inject command's end (the fault is applied just before it): median "
                f"{statistics.median(after):.1f} s, worst {max(after):.1f} s"
            )
        took = [r.inject_s for r in runs[name] if r.inject_s is not None]
        if took:
            print(f"the inject command took {min(took):.1f}–{max(took):.1f} s (the fault is in it)")
        spaced = [(r.redone, r.every) for r in runs[name] if r.every is not None]
        if spaced:
            within = sum(1 for redone, every in spaced if redone is not None and redone <= every)
            print(f"redone within the snapshots' spacing: {within} of {len(spaced)} faults")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "runs": {name: [asdict(r) for r in results] for name, results in runs.items()},
                    "summaries": summaries,
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
