"""Nodes that boot: containers running real systemd as PID 1, built from the Dockerfile,
with the agent's and the coordinator's units enabled as a user's image would enable them.
Everything checked here is what systemd itself says (``systemctl show``, the journal) and
what ``coordinatorctl`` says of the cluster: the agent is started at boot and reaches
``READY=1`` with its status line, the watchdog kills a wedged agent, ``Restart=`` brings
back a killed one that adopts the rank it left running, ``systemctl restart`` and ``stop``
leave the ranks running (``KillMode=process``), a rebooted node re-registers and its job
recovers as from a node loss, and a killed coordinator is restarted while its standby
leads.

The job is a shell loop (this image has no training stack): a rank with no rank API, which
the agent starts, watches and reports like any other.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hardening
import images
import pytest
from cluster import BootCluster, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(images.unavailable()), reason=images.unavailable() or ""),
]
UNITS = Path(__file__).resolve().parents[2] / "systemd"
AGENT = "ringmaster-nodeagent.service"
COORDINATOR = "ringmaster-coordinator.service"
RANK = "sleep 86401"  # the job's rank, as pgrep finds it
JOB = f"""
[job]
name = "boot-sleeper"
nodes = 2
min_nodes = 1
entry = ["/bin/sh", "-c", "exec {RANK}"]
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootCluster]:
    images.build()
    booted = BootCluster(tmp_path_factory.mktemp("boot"))
    try:
        booted.up(nodes=2, coordinators=2)
        booted.configure("coord-0", "boot-sleeper.toml", JOB)
        yield booted
    finally:
        with contextlib.suppress(Exception):  # shown with a failure: what the cluster said
            for e in booted.events():
                print(e["time"], e["kind"], e.get("node") or "-", e["message"])
        booted.down()


def active(c: BootCluster, host: str, unit: str) -> dict[str, str] | None:
    shown = c.show(host, unit)
    running = (shown.get("ActiveState"), shown.get("SubState")) == ("active", "running")
    return shown if running else None


def rank_pid(c: BootCluster, host: str) -> int | None:
    out = c.sh(host, f"pgrep -f '^{RANK}$' || true").split()
    return int(out[0]) if out else None


def job_view(c: BootCluster, job: str) -> dict[str, Any]:
    return json.loads(c.ctl("status", job, "--json"))


def test_every_sandbox_directive_of_the_units_holds_or_says_why_it_cannot_be_checked(
    cluster: BootCluster,
) -> None:
    c = cluster
    host_caps = int(Path("/proc/self/status").read_text().split("CapBnd:")[1].split()[0], 16)
    for host, unit in (("node-0", AGENT), ("coord-0", COORDINATOR)):
        wait_for(lambda h=host, u=unit: active(c, h, u), 60, lambda h=host, u=unit: c.journal(h, u))
        report = hardening.check(c, host, UNITS / unit, host_caps)
        print(unit, json.dumps(report, indent=1))
        failed = {k: v for k, v in report.items() if v.startswith("FAILED")}
        assert not failed, failed


def test_agents_and_coordinators_boot_under_systemd_and_survive_what_systemd_does(
    cluster: BootCluster,
) -> None:
    c = cluster
    # at boot, with nobody starting them: active once READY=1 came, with a status line
    for host in ("node-0", "node-1"):
        shown = wait_for(lambda h=host: active(c, h, AGENT), 60, lambda h=host: c.journal(h, AGENT))
        assert shown["Type"] == "notify" and shown["NRestarts"] == "0", shown
        assert "collectors ok" in shown["StatusText"], shown
        assert "Started ringmaster-nodeagent.service" in c.journal(host, AGENT)
    for host in ("coord-0", "coord-1"):
        shown = wait_for(
            lambda h=host: active(c, h, COORDINATOR),
            60,
            lambda h=host: c.journal(h, COORDINATOR),
        )
        assert shown["StatusText"].startswith(("leader", "follower")), shown
    wait_for(
        lambda: {n["id"] for n in c.status()["nodes"]} >= {"node-0", "node-1"} or None,
        60,
        lambda: str(c.status()["nodes"]),
    )

    job = c.ctl("start", "/etc/ringmaster/boot-sleeper.toml").strip()
    pids = {
        host: wait_for(lambda h=host: rank_pid(c, h), 60, lambda: str(job_view(c, job)))
        for host in ("node-0", "node-1")
    }

    # SIGKILL: Restart= brings the agent back, and it adopts the rank that kept running
    first = c.show("node-0", AGENT)
    c.sh("node-0", f"systemctl kill --kill-whom=main --signal=KILL {AGENT}")
    again = wait_for(
        lambda: ((s := active(c, "node-0", AGENT)) and s["NRestarts"] == "1" and s) or None,
        60,
        lambda: c.journal("node-0", AGENT)[-3000:],
    )
    assert again["MainPID"] != first["MainPID"]
    assert rank_pid(c, "node-0") == pids["node-0"], [
        (e["kind"], e["message"]) for e in c.events("--job", job)
    ]
    wait_for(lambda: adoptions(c, "node-0", job) == 1 or None, 30, lambda: "no adoption")
    # ... and sees its exit: the job recovers from it
    c.sh("node-0", f"kill {pids['node-0']}")
    exited = wait_for(lambda: events(c, job, "worker.exited") or None, 60, lambda: "no exit seen")
    assert exited[0]["node"] == "node-0", exited
    pids = ranks_again(c, job, pids, restarts=1)

    # systemctl restart and stop signal the agent alone: its rank keeps running, adopted
    for verb in ("restart", "stop"):
        before = c.show("node-1", AGENT)
        c.sh("node-1", f"systemctl {verb} {AGENT}")
        assert rank_pid(c, "node-1") == pids["node-1"], f"systemctl {verb} killed the rank"
    assert c.show("node-1", AGENT)["ActiveState"] == "inactive"
    c.sh("node-1", f"systemctl start {AGENT}")
    wait_for(lambda: active(c, "node-1", AGENT), 60, lambda: c.journal("node-1", AGENT)[-3000:])
    assert adoptions(c, "node-1", job) == 2, "restart and start each adopt"
    assert c.show("node-1", AGENT)["NRestarts"] == before["NRestarts"]
    assert job_view(c, job)["restarts"] == 1, "an agent restart cost the job a restart"

    # a wedged agent (SIGSTOP): the watchdog (3 s in a drop-in here; 30 s shipped) kills it
    # and Restart= brings it back, its rank adopted again
    c.sh("node-0", "mkdir -p /run/systemd/system/ringmaster-nodeagent.service.d && printf "
         "'[Service]\\nWatchdogSec=3\\n' > /run/systemd/system/ringmaster-nodeagent.service.d/"
         f"watchdog.conf && systemctl daemon-reload && systemctl restart {AGENT}")  # fmt: skip
    shown = wait_for(lambda: active(c, "node-0", AGENT), 60, lambda: "not back")
    assert shown["WatchdogUSec"] == "3s", shown
    restarts = int(shown["NRestarts"])  # an operator's restart starts the count again
    c.sh("node-0", f"systemctl kill --kill-whom=main --signal=STOP {AGENT}")
    wait_for(
        lambda: ((s := active(c, "node-0", AGENT)) and int(s["NRestarts"]) == restarts + 1) or None,
        60,
        lambda: c.journal("node-0", AGENT)[-3000:],
    )
    assert "Watchdog timeout (limit 3s)" in c.journal("node-0", AGENT)
    assert rank_pid(c, "node-0") == pids["node-0"], c.events("--job", job)
    c.sh("node-0", "rm -r /run/systemd/system/ringmaster-nodeagent.service.d && "
         f"systemctl daemon-reload && systemctl restart {AGENT}")  # fmt: skip

    # a reboot: systemd stops everything, the container starts again, the agent is started
    # at boot and registers again, and the job recovers as from a lost node
    registered = len(c.events("--node", "node-1", "--kind", "node.registered"))
    c.restart_container("node-1")
    wait_for(lambda: active(c, "node-1", AGENT), 60, lambda: c.journal("node-1", AGENT)[-3000:])
    wait_for(
        lambda: len(c.events("--node", "node-1", "--kind", "node.registered")) > registered or None,
        60,
        lambda: "node-1 did not register again",
    )
    # the agent's SIGTERM came while systemd was stopping: a notice that node-1 is going
    # away, and the job evacuated it, going on with node-0 until node-1 is back
    [recovering] = events(c, job, "job.recovering")[1:2]
    assert "node-1" in recovering["message"], recovering
    ranks_again(c, job, {"node-0": pids["node-0"]}, restarts=2)

    # the coordinator's unit: a leader killed outright is restarted, and one of the two leads
    leader = next(h for h in ("coord-0", "coord-1") if c.show(h, COORDINATOR)["StatusText"]
                  .startswith("leader"))  # fmt: skip
    c.sh(leader, f"systemctl kill --kill-whom=main --signal=KILL {COORDINATOR}")
    wait_for(
        lambda: ((s := active(c, leader, COORDINATOR)) and s["NRestarts"] == "1") or None,
        60,
        lambda: c.journal(leader, COORDINATOR)[-3000:],
    )
    wait_for(
        lambda: len(c.events("--kind", "coordinator.leader")) >= 2 or None,
        60,
        lambda: str(c.events("--kind", "coordinator.*")),
    )
    c.ctl("stop", job)
    assert job_view(c, job)["restarts"] == 2


def adoptions(c: BootCluster, host: str, job: str) -> int:
    """How many times an agent on ``host`` said it adopted ``job``'s ranks."""
    said = [json.loads(line) for line in c.journal(host, AGENT).splitlines() if line[:1] == "{"]
    return sum(1 for e in said if e["event"] == "ranks adopted" and e.get("job") == job)


def events(c: BootCluster, job: str, kind: str) -> list[dict[str, Any]]:
    return c.events("--job", job, "--kind", kind)


def ranks_again(c: BootCluster, job: str, pids: dict[str, int], restarts: int) -> dict[str, int]:
    """The job's new ranks after its ``restarts``-th restart, one on each node."""
    wait_for(lambda: job_view(c, job)["restarts"] >= restarts or None, 90, lambda: "no restart")
    new = {
        host: wait_for(
            lambda h=host: ((p := rank_pid(c, h)) != pids[h] and p) or None,
            90,
            lambda: str(job_view(c, job)),
        )
        for host in pids
    }
    assert job_view(c, job)["restarts"] == restarts
    return new
