"""Nodes that boot: what systemd's handling of the agent costs, on containers booting real
systemd from the Dockerfile's image (tests/boot: podman, one NATS, one coordinator, nodes
with ``ringmaster-nodeagent.service`` enabled as a user's image enables it).

    sudo .venv/bin/python bench/boot_nodes.py [--trials 3] [--json OUT.json]

- boot → registered: ``podman run`` of a new node container to systemd's ``READY=1`` for
  the agent (``ActiveEnterTimestampMonotonic``) and to the coordinator's ``node.registered``.
- SIGKILL → back: ``systemctl kill --kill-whom=main --signal=KILL`` of an agent whose node
  runs a rank of a job, to the restarted agent's ``ranks adopted`` line, its ``READY=1``
  and its ``node.registered``; the rank's PID is the same throughout and the job is not
  restarted.
- wedged → restarted: ``SIGSTOP`` of the agent to systemd's ``Watchdog timeout`` and to
  the restarted agent's ``READY=1``, with the shipped ``WatchdogSec=30`` and with 3 s in a
  drop-in.

Times on the host's monotonic clock, which systemd and journald inside the containers
share; event times on the wall clock. Image sizes as ``podman image inspect`` reports.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "boot"))

import images  # noqa: E402
from cluster import BootCluster, wait_for  # noqa: E402

AGENT = "ringmaster-nodeagent.service"
JOB = '[job]\nname = "bench-sleeper"\nnodes = 1\nentry = ["/bin/sh", "-c", "exec sleep 86402"]\n'
DROP_IN = "/run/systemd/system/ringmaster-nodeagent.service.d"


def wall(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def ready_at(c: BootCluster, host: str, restarts: int | None = None) -> float:
    """When systemd last saw the agent's READY=1 (monotonic s), once it is active again
    (with ``restarts`` automatic restarts, if given)."""

    def ready() -> float | None:
        s = c.show(host, AGENT)
        if (s.get("ActiveState"), s.get("SubState")) != ("active", "running"):
            return None
        if restarts is not None and int(s["NRestarts"]) != restarts:
            return None
        return int(s["ActiveEnterTimestampMonotonic"]) / 1e6

    return wait_for(ready, 120, lambda: c.journal(host, AGENT)[-2000:])


def registered_after(c: BootCluster, host: str, after: float) -> float:
    def found() -> float | None:
        times = [wall(e["time"]) for e in c.events("--node", host, "--kind", "node.registered")]
        later = [t for t in times if t > after]
        return min(later) if later else None

    return wait_for(found, 120, lambda: f"{host} did not register")


def journal_mono(c: BootCluster, host: str, text: str, after: float) -> float:
    """The monotonic time of the first journal line of the agent's unit holding ``text``
    after ``after``."""

    def found() -> float | None:
        out = c.sh(host, f"journalctl -u {AGENT} -o short-monotonic --no-pager", check=False)
        for line in out.splitlines():
            if text in line and line.startswith("["):
                at = float(line[1 : line.index("]")])
                if at > after:
                    return at
        return None

    return wait_for(found, 120, lambda: f"no {text!r} on {host}")


def boot(c: BootCluster, trials: int) -> list[dict[str, float]]:
    out = []
    for i in range(trials):
        host = f"node-{10 + i}"
        c.configure(host, "agent.toml", c.agent_toml())
        t_wall, t_mono = time.time(), time.monotonic()
        c.add_node(host)
        ready = ready_at(c, host)
        out.append(
            {"ready_s": ready - t_mono, "registered_s": registered_after(c, host, t_wall) - t_wall}
        )
        print(f"boot {i}: {out[-1]}", flush=True)
    return out


def rank_pid(c: BootCluster, host: str) -> str:
    return c.sh(host, "pgrep -f '^sleep 86402$' || true").strip()


def sigkill(c: BootCluster, job: str, trials: int) -> list[dict[str, float]]:
    out = []
    pid = wait_for(lambda: rank_pid(c, "node-0") or None, 60, lambda: "no rank")
    for i in range(trials):
        restarts = int(c.show("node-0", AGENT)["NRestarts"])
        t_wall, t_mono = time.time(), time.monotonic()
        c.sh("node-0", f"systemctl kill --kill-whom=main --signal=KILL {AGENT}")
        ready = ready_at(c, "node-0", restarts + 1)
        adopted = journal_mono(c, "node-0", '"ranks adopted"', t_mono)
        out.append(
            {
                "adopted_s": adopted - t_mono,
                "ready_s": ready - t_mono,
                "registered_s": registered_after(c, "node-0", t_wall) - t_wall,
            }
        )
        assert rank_pid(c, "node-0") == pid, "the rank did not survive"
        print(f"sigkill {i}: {out[-1]}", flush=True)
    status = json.loads(c.ctl("status", job, "--json"))
    assert status["restarts"] == 0, status
    return out


def wedge(c: BootCluster, trials: int, watchdog_s: int | None) -> list[dict[str, float]]:
    host = "node-1"
    if watchdog_s is not None:
        setting = f"printf '[Service]\\nWatchdogSec={watchdog_s}\\n' > {DROP_IN}/watchdog.conf"
        c.sh(host, f"mkdir -p {DROP_IN} && {setting} && systemctl daemon-reload")
        c.sh(host, f"systemctl restart {AGENT}")
    out = []
    for i in range(trials):
        ready_at(c, host)
        restarts = int(c.show(host, AGENT)["NRestarts"])
        t_mono = time.monotonic()
        c.sh(host, f"systemctl kill --kill-whom=main --signal=STOP {AGENT}")
        fired = journal_mono(c, host, "Watchdog timeout", t_mono)
        ready = ready_at(c, host, restarts + 1)
        out.append({"watchdog_s": fired - t_mono, "ready_s": ready - t_mono})
        print(f"wedge ({watchdog_s or 'shipped'}) {i}: {out[-1]}", flush=True)
    if watchdog_s is not None:
        c.sh(host, f"rm -r {DROP_IN} && systemctl daemon-reload && systemctl restart {AGENT}")
    return out


def summary(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {
        k: {"median": statistics.median(r[k] for r in rows), "max": max(r[k] for r in rows)}
        for k in rows[0]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if why := images.unavailable():
        sys.exit(f"boot_nodes: {why}")
    images.build()
    c = BootCluster(Path(tempfile.mkdtemp(prefix="ringmaster-boot-")))
    result: dict[str, Any] = {}
    try:
        c.up(nodes=2, coordinators=1)
        c.configure("coord-0", "bench-sleeper.toml", JOB)
        ready_at(c, "node-0")
        ready_at(c, "node-1")
        wait_for(lambda: len(c.status()["nodes"]) >= 2 or None, 60, lambda: "nodes missing")
        job = c.ctl("start", "/etc/ringmaster/bench-sleeper.toml").strip()
        result["boot"] = summary(boot(c, args.trials))
        result["sigkill"] = summary(sigkill(c, job, args.trials))
        result["wedge_3s"] = summary(wedge(c, args.trials, 3))
        result["wedge_shipped"] = summary(wedge(c, max(1, args.trials - 1), None))
        result["image_mb"] = {
            tag: round(images.size_mb(tag))
            for tag in (images.CONTROL_PLANE, "localhost/ringmaster:gpu-node")
            if images.exists(tag)
        }
    finally:
        c.down()
        shutil.rmtree(c.workdir, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
