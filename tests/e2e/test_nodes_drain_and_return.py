"""A node's life on one 3-node local cluster, through coordinatorctl: a node drained for
a fault is admitted again once the fault closes and its probation passes (a new job is
placed there), the same fault three times holds it until ``undrain``; the operator's
``cordon`` leaves a running job where it is, ``drain`` moves it off the node from a
checkpoint at its stop step without spending a restart, ``undrain`` gives the node back;
an undrain that cannot return a node says why, exit 1.

The NVMe probation is cut to 10 s (``RINGMASTER_PROBATION``; the defaults are in
``coordinator.node_life`` and their own unit test). With ``-s`` the scenario prints its
figures (docs/benchmarks.md, "A node's life")."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from cli_harness import Ctl, eventually, restarted

pytestmark = pytest.mark.slow
PROBATION_S = 10.0
FAST = ("train.engine=ddp", "train.precision=fp32")


def node(ctl: Ctl, name: str) -> dict[str, Any]:
    return next(dict(n) for n in ctl.view(None)["nodes"] if n["id"] == name)


def until(
    ctl: Ctl, name: str, pred: Callable[[dict[str, Any]], object], timeout: float = 30
) -> dict[str, Any]:
    """Node ``name``'s record once ``pred`` holds (records follow within a second)."""
    return eventually(
        lambda: pred(n := node(ctl, name)) and n,
        timeout,
        lambda: f"{name}: {node(ctl, name)}",
        0.25,
    )


def in_state(ctl: Ctl, name: str, state: str, timeout: float = 30) -> dict[str, Any]:
    return until(ctl, name, lambda n: n["state"] == state, timeout)


def on_probation(ctl: Ctl, name: str) -> dict[str, Any]:
    return until(ctl, name, lambda n: n["drain_reason"].startswith("probation after"))


def seconds(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["time"]).timestamp()


def last(ctl: Ctl, name: str, kind: str, **fields: object) -> dict[str, Any]:
    """The newest ``kind`` event of node ``name`` with ``fields``, waiting for one."""

    def found() -> dict[str, Any] | None:
        seen = [
            e
            for e in ctl.events("--node", name, "--kind", kind)
            if all(e.get(k) == v for k, v in fields.items())
        ]
        return seen[-1] if seen else None

    return eventually(found, 60, lambda: f"no {kind} {fields} on {name}", 0.5)


@pytest.mark.timeout(600)
def test_a_nodes_life_faults_probation_holds_and_the_operators_verbs(
    ctl: Ctl, tmp_path: Path
) -> None:
    ctl.env["RINGMASTER_PROBATION"] = f"nvme.readonly={PROBATION_S:g}"
    ctl("up", "--nodes", "3")
    # the job leaves a node out after a fault of its own for 5 s (its policy.exclude_s)
    job = ctl.start(
        "tiny.toml",
        *FAST,
        "train.steps=100000",
        "policy.exclude_s=5",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    )
    first = ctl.wait(job, lambda s: s["state"] == "running" and s["step"] >= 3)
    assert first["nodes"] == ["node-0", "node-1"]

    # a fault drains node-1 with its evidence; the job goes on without it
    ctl("inject", "node-1", "nvme-readonly=on")
    drained = last(ctl, "node-1", "node.drained")
    assert drained["cause"].startswith("nvme.readonly:node-1:") and drained["by"] == "ringmaster"
    assert "read-only" in drained["evidence"]
    assert in_state(ctl, "node-1", "draining")["drained_by"] == "ringmaster"
    ctl.wait(job, lambda s: s["state"] == "running" and s["nodes"] == ["node-0", "node-2"])

    # the device writable again: on probation, then ready, said with the evidence
    ctl("inject", "node-1", "nvme-readonly=off")
    closed = last(ctl, "node-1", "nvme.readonly", readonly=False)
    on_probation(ctl, "node-1")
    in_state(ctl, "node-1", "ready", timeout=PROBATION_S + 20)
    returned = last(ctl, "node-1", "node.returned")
    assert returned["probation_s"] == PROBATION_S and "health gate passed" in returned["evidence"]
    back_in = seconds(returned) - seconds(closed)
    assert PROBATION_S <= back_in <= PROBATION_S + 3, back_in  # probation plus a heartbeat
    # admitted again: the free node takes a new job
    other = ctl.start(
        "tiny.toml",
        *FAST,
        "job.nodes=1",
        "train.steps=100000",
        f"checkpoint.dir={tmp_path / 'other'}",
    )
    placed = ctl.wait(other, lambda s: s["state"] == "running" and s["step"] >= 1)
    assert placed["nodes"] == ["node-1"], placed
    ctl("stop", other)
    ctl.wait(other, lambda s: s["state"] == "stopped")

    # the same fault twice more within the hour: held for a person, whatever its device does
    ctl("inject", "node-1", "nvme-readonly=on")
    in_state(ctl, "node-1", "draining")
    ctl("inject", "node-1", "nvme-readonly=off")
    on_probation(ctl, "node-1")
    ctl("inject", "node-1", "nvme-readonly=on")
    held = eventually(
        lambda: [e for e in ctl.events("--node", "node-1", "--kind", "node.drained") if e["held"]],
        30,
        lambda: "node-1 never held",
        0.5,
    )[0]
    assert (
        held["severity"] == "critical" and "nvme.readonly 3 times within 60 min" in held["history"]
    )
    ctl("inject", "node-1", "nvme-readonly=off")
    still = until(ctl, "node-1", lambda n: not n["conditions"])  # the device fine again
    assert still["state"] == "draining" and still["held"] and still["probation_until"] is None
    assert "held for a person" in still["drain_reason"]
    ctl("undrain", "node-1")
    assert not in_state(ctl, "node-1", "ready")["held"]

    # cordon the job's node: no new placements there, the job trains on
    before = ctl.view(job)
    ctl("cordon", "node-0", "--reason", "kernel update")
    assert until(ctl, "node-0", lambda n: n["cordoned_by"])["state"] == "ready"
    on = ctl.wait(job, lambda s: s["step"] >= before["step"] + 5)
    assert on["restarts"] == before["restarts"] and on["nodes"] == before["nodes"]

    # drain it: the job stops at a step with a checkpoint and resumes there elsewhere
    drained_at = time.time()
    ctl("drain", "node-0", "--reason", "disk swap")
    moved = restarted(ctl, job, before["restarts"] + 1)
    assert sorted(moved["nodes"]) == ["node-1", "node-2"], moved
    training = ctl.wait(job, lambda s: s["state"] == "running" and s["step"] > moved["from_step"])
    took = time.time() - drained_at
    events = ctl.events("--job", job)
    [recovering] = [e for e in events if e["kind"] == "job.recovering"][-1:]
    assert recovering["reason"].startswith("node-0 drained: drained by "), recovering
    saved = [e["step"] for e in events if e["kind"] == "job.checkpointed"]
    assert saved and moved["from_step"] == saved[-1], (saved, moved)  # 0 steps lost
    assert training["restarts"] == before["restarts"]  # nothing failed: no restart spent
    op = in_state(ctl, "node-0", "draining")
    assert op["drain_reason"].endswith("disk swap"), op
    assert op["drained_by"] == last(ctl, "node-0", "node.drained")["by"] != "ringmaster"

    # undrain: back in placement, its cordon lifted too
    ctl("undrain", "node-0")
    until(ctl, "node-0", lambda n: n["state"] == "ready" and not n["cordoned_by"])
    kinds = [(e["kind"], e.get("cordoned")) for e in ctl.events("--node", "node-0")]
    assert ("node.cordoned", True) in kinds and ("node.cordoned", False) in kinds
    assert last(ctl, "node-0", "node.returned")["evidence"].startswith("undrained by ")

    # an undrain that cannot return a node says why, exit 1; an unknown node, exit 2
    ctl("inject", "node-0", "nvme-readonly=on")
    in_state(ctl, "node-0", "draining")
    refused = ctl.run("undrain", "node-0")
    assert refused.returncode == 1 and "stays drained for nvme.readonly" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    unknown = ctl.run("drain", "node-9", "--reason", "x")
    assert unknown.returncode == 2 and "no node 'node-9'" in unknown.stderr
    ctl("inject", "node-0", "nvme-readonly=off")
    print(f"==> condition closed to admitted again: {back_in:.1f} s ({PROBATION_S:g} s probation)")
    print(f"==> drain to the job training on elsewhere: {took:.1f} s")
