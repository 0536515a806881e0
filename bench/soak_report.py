"""The end of ``bench/soak.py``: the job's state, restarts and rewinds, each fault's
restarts and time back to training (counted again now, so that an attempt that came only
after the next fault counts), the goodput ledger, the productive share, the longest stall,
and every node's state at the end, with why for each live node that is not ready."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from bench.cluster_harness import read_records
from bench.soak_plan import STUCK_S, cost_by_fault, longest_stall, not_ready, unsettled

if TYPE_CHECKING:
    from bench.soak import Soak


def report(
    soak: Soak, faults: list[dict[str, Any]], args: Any, nodes: list[dict[str, Any]], waited: float
) -> dict[str, Any]:
    """Printed and returned; ``nodes``: each node at the end, as :func:`bench.soak_watch.
    settle` left them, ``waited`` seconds after the last fault's window."""
    final, t0 = soak.ctl.status(soak.job), soak.t0
    goodput: dict[str, float] = final["goodput"]
    total = sum(goodput.values())
    steps = [r.wall for r in read_records(soak.ctl.logs(soak.job)) if r.event == "step"]
    stall, began = longest_stall(steps, soak.sampler.excused(), t0, time.time())
    out = {
        "settings": {"minutes": args.minutes, "every": args.every, "seed": args.seed},
        "job": {k: final.get(k) for k in ("id", "state", "step", "restarts", "rewinds", "reason")},
        "faults": faults,
        "goodput": goodput,
        "productive_share": round(goodput.get("productive", 0.0) / total, 3) if total else None,
        "longest_stall_s": stall,
        "longest_stall_at_s": round(began - t0, 1),
    }
    out["stuck"] = stall > STUCK_S
    out["nodes"] = [{k: n.get(k) for k in ("id", "state", "held", "why")} for n in nodes]
    out["not_ready"], out["unsettled"] = not_ready(nodes), unsettled(nodes)
    print(
        f"\njob {final['state']} at step {final['step']}, restarts {final['restarts']}, "
        f"rewinds {final.get('rewinds', 0)}"
    )
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
    out["cost_by_fault"] = cost_by_fault(faults)
    print("not productive, by the fault whose window it fell in (GPU-s):")
    for kind, gpu_s, buckets in out["cost_by_fault"]:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(buckets.items(), key=lambda i: -i[1]))
        print(f"  {kind:13} {gpu_s:6.1f}" + (f"  ({parts})" if parts else ""))
    share = out["productive_share"]
    print(f"productive share: {'-' if share is None else f'{100 * share:.1f} %'}")
    print(
        f"longest stretch without a step (not paused, not waiting for nodes): {stall:.1f} s, "
        f"from {began - t0:.0f} s" + (" — stuck" if out["stuck"] else "")
    )
    states = ", ".join(
        f"{n['id']} {n['state']}" + (" (held)" if n.get("held") else "") for n in nodes
    )
    print(f"nodes at the end ({waited:.0f} s after the last fault's window): {states}")
    if not out["not_ready"]:
        print("every live node is ready")
    for n in out["not_ready"]:
        print(f"  not ready: {n['node']} {n['state']}{', held' if n['held'] else ''}: {n['why']}")
    return out
