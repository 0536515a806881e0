"""What the Hugging Face integration costs a step: the same ``Trainer`` script with its
two-line callback and without, as jobs on one local cluster, in one run.

    .venv/bin/python bench/integration_cost.py [--steps 800] [--rounds 2] [--warmup 50]
        [--memory on|off] [--model "--layers 6 --width 256"] [--json OUT.json]

``coordinatorctl up --nodes 2`` (no spare interpreters); then, ``--rounds`` times, the
script without its integration lines, then with them (``examples/hf_trainer.py``, two
ranks, one a node),
each for ``--steps`` steps. Every step is timed the same way in both, by
``bench/hf_steps.py``'s stopwatch callback (the time between consecutive ``on_step_end``,
so it holds whatever the integration does there: the step's agreement, the beat, progress
out, memory snapshots and their share of background work). Each run's figure is rank 0's
median step time after ``--warmup`` steps; the cost is the ratio of the runs with the
callback to those without, per round and over all. ``--memory off`` leaves the memory
tier out of the job (``checkpoint.memory_tier = false``), to tell its share apart;
``--model`` passes the script a larger GPT-2 (its ``--layers`` and ``--width``): the
example's default (2 layers of 64) steps in about 20 ms here, where any fixed cost a step
shows most.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster_harness import REPO, Ctl, read_records, wait_for

SCRIPT = REPO / "examples" / "hf_trainer.py"
STOPWATCH = REPO / "bench" / "hf_steps.py"


def unmodified(into: Path) -> Path:
    lines = SCRIPT.read_text().splitlines()
    into.write_text("\n".join(x for x in lines if not x.rstrip().endswith("# ringmaster")))
    return into


def job_file(
    root: Path, name: str, script: Path, steps: int, memory: bool, model: list[str]
) -> Path:
    """A job of ``script`` under the stopwatch; each run gets an output dir of its own
    (``--set`` at start), so none resumes from the Trainer's checkpoint of an earlier."""
    argv = [str(STOPWATCH), str(script), "--out", "OUT"]
    argv += ["--steps", str(steps), "--save-steps", str(10 * steps), *model]
    path = root / f"{name}.toml"
    path.write_text(
        f'[job]\nname = "{name}"\nnodes = 2\nentry = {json.dumps(argv)}\n'
        '[job.env]\nRINGMASTER_BENCH_WATCH = "watch"\n'
        f'[checkpoint]\ndir = "{root / ("ckpt-" + name)}"\n'
        f"memory_tier = {'true' if memory else 'false'}\n"
    )
    return path


def run(ctl: Ctl, path: Path, warmup: int, out: Path) -> dict[str, float]:
    entry = json.loads(path.read_text().split("entry = ", 1)[1].splitlines()[0])
    entry[entry.index("OUT")] = str(out)
    job = ctl("start", str(path), "--set", f"job.entry={json.dumps(entry)}").strip()
    ended = wait_for(
        lambda: s if (s := ctl.status(job))["state"] in ("completed", "failed") else None,
        1800,
        1.0,
    )
    if ended is None or ended["state"] != "completed":
        raise RuntimeError(f"{job} did not complete: {ended}")
    logs = [p for p in ctl.logs(job) if p.name == "rank-0.log"]
    steps = [r for r in read_records(logs) if r.event == "watch_step"]
    times = [float(r.fields["step_s"]) for r in steps if int(r.fields["step"]) > warmup]
    if ended.get("restarts"):
        raise RuntimeError(f"{job} restarted: its steps are no measure of a step's cost")
    return {"median_s": statistics.median(times), "steps": len(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--memory", choices=("on", "off"), default="on")
    parser.add_argument("--model", default="", help='the script\'s size: "--layers N --width W"')
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    memory = args.memory == "on"
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="ringmaster-integration-cost-") as tmp:
        root = Path(tmp)
        ctl = Ctl(root / "cluster", root)
        # no spare interpreters: their imports after each launch would take the cores from
        # the very steps measured here (a restart's speed is bench/recovery.py's)
        ctl.env["RINGMASTER_WARM_RANKS"] = "0"
        model = args.model.split()
        plain = job_file(root, "plain", unmodified(root / "hf_plain.py"), args.steps, memory, model)
        hooked = job_file(root, "callback", SCRIPT, args.steps, memory, model)
        ctl("up", "--nodes", "2")
        try:
            for i in range(args.rounds):
                begun = time.time()
                measured = {"without": run(ctl, plain, args.warmup, root / f"out-plain-{i}")}
                measured["with"] = run(ctl, hooked, args.warmup, root / f"out-callback-{i}")
                rounds.append(measured)
                ratio = measured["with"]["median_s"] / measured["without"]["median_s"]
                took = time.time() - begun
                print(
                    f"round {i + 1}: {measured} ratio {ratio:.4f} ({took:.0f} s)", file=sys.stderr
                )
        finally:
            ctl("down", check=False)
    print("| round | without (median s/step) | with | with / without |")
    print("|---|---|---|---|")
    for i, m in enumerate(rounds, 1):
        a, b = m["without"]["median_s"], m["with"]["median_s"]
        print(f"| {i} | {a:.5f} | {b:.5f} | {b / a:.4f} |")
    without = statistics.median(m["without"]["median_s"] for m in rounds)
    with_ = statistics.median(m["with"]["median_s"] for m in rounds)
    print(f"\nover all rounds: {with_:.5f} / {without:.5f} = {with_ / without:.4f}")
    if args.json:
        out = {"rounds": rounds, "memory": memory, "model": args.model}
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
