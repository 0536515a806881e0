"""A Ringmaster cluster of containers that boot systemd: one NATS server, coordinators and
nodes, each its own container on an internal network of its own (in 198.19.0.0/16, part
of the RFC 2544 benchmarking space, with no route out).

Every node and coordinator runs the image its role's unit is enabled in
(``images.ROLES``) with ``/sbin/init`` as PID 1 and its configuration bound into
``/etc/ringmaster``, as a user's host would: nothing inside is started by hand. What the
tests read comes from systemd itself (``systemctl show``, the journal) and from
``coordinatorctl`` run in a coordinator's container.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from images import CONTROL_PLANE, ROLES, podman

from coordinator.ctl import netns
from ringmaster.procs import wait_until

LABEL = "ringmaster.boot-owner"  # the PID of the process that made it
CLUSTER = "boot"
T = TypeVar("T")
NODE_CAPS = ("SYS_ADMIN", "DAC_READ_SEARCH", "SYS_NICE", "SYS_RESOURCE", "IPC_LOCK")


def wait_for(check: Callable[[], T | None], timeout: float, what: Callable[[], str]) -> T:
    """``check``'s first truthy result; an AssertionError saying ``what()`` if none comes
    within ``timeout`` s."""
    try:
        return wait_until(check, timeout, 0.2)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout:.0f} s: {what()}") from None


def remove_orphans() -> None:
    """Containers and networks an earlier run of the tests left behind (its process gone)."""
    for kind in ("container", "network"):
        listed = podman(kind, "ls", "-a" if kind == "container" else "-q", "--format",
                        "{{.Name}} {{index .Labels \"" + LABEL + "\"}}", check=False)  # fmt: skip
        for line in listed.splitlines():
            name, _, owner = line.partition(" ")
            if owner.strip().isdigit() and not Path(f"/proc/{owner.strip()}").exists():
                podman(kind, "rm", "-f", name, check=False)


def free_subnet() -> str:
    taken = podman("network", "ls", "--format", "{{range .Subnets}}{{.Subnet}} {{end}}")
    for third in range(2, 250):
        subnet = f"198.19.{third}.0/24"
        if subnet not in taken.split() and not netns.in_use(subnet):
            return subnet
    raise RuntimeError("no free /24 in 198.19.0.0/16 for the booting nodes' network")


class BootCluster:
    def __init__(self, workdir: Path) -> None:
        self.token = secrets.token_hex(3)
        self.network = f"rmboot-{self.token}"
        self.workdir = workdir
        self.containers: list[str] = []
        self.nats_url = ""

    def name(self, host: str) -> str:
        return f"rmboot-{self.token}-{host}"

    def up(self, nodes: int, coordinators: int) -> None:
        remove_orphans()
        label = f"{LABEL}={os.getpid()}"
        subnet = free_subnet()
        podman("network", "create", "--internal", "--label", label, "--subnet", subnet,
               self.network)  # fmt: skip
        # NATS at a fixed address: a name would be looked up again at every reconnect, and
        # the network's resolver restarts when a container does
        nats_ip = subnet.replace(".0/24", ".2")
        self.nats_url = f"nats://{nats_ip}:4222"
        server = ["/opt/ringmaster/bin/nats-server", "-js", "-sd", "/var/lib/nats", "-p", "4222"]
        self._run("nats", "nats", CONTROL_PLANE, ["--ip", nats_ip], server)
        for i in range(coordinators):
            env = f"RINGMASTER_NATS={self.nats_url}\nRINGMASTER_CLUSTER={CLUSTER}\n"
            self.configure(f"coord-{i}", "coordinator.env", env)
            self._run(f"coord-{i}", "coordinator", ROLES["coordinator"][1], [], [])
        for i in range(nodes):
            self.configure(f"node-{i}", "agent.toml", self.agent_toml())
            self.add_node(f"node-{i}")

    def agent_toml(self) -> str:
        # no GPU here: one "GPU" for one rank, and no warm spares (this image has no
        # training stack for them to import)
        return f'cluster = "{CLUSTER}"\nnats = "{self.nats_url}"\ngpus = 1\nwarm_ranks = 0\n'

    def add_node(self, host: str) -> None:
        """A node container booting with its agent's unit enabled (``configure`` first)."""
        self._run(host, "node", ROLES["node"][1], [], [])

    def configure(self, host: str, filename: str, text: str) -> None:
        folder = self.workdir / host
        folder.mkdir(parents=True, exist_ok=True)
        (folder / filename).write_text(text)

    def _run(
        self, host: str, role: str, image: str, options: list[str], command: list[str]
    ) -> None:
        args = ["run", "-d", "--name", self.name(host), "--hostname", host,
                "--network", self.network, "--network-alias", host,
                "--label", f"{LABEL}={os.getpid()}", "--shm-size", "8g"]  # fmt: skip
        if role != "nats":
            args += ["-v", f"{self.workdir / host}:/etc/ringmaster:ro"]
        if role == "node":
            # what the agent's unit keeps of its capabilities beyond podman's defaults:
            # a node's container must grant them (docs/operations.md, "Container images")
            args += [f"--cap-add={cap}" for cap in NODE_CAPS]
        podman(*args, *options, image, *command)
        self.containers.append(self.name(host))

    def down(self) -> None:
        for container in self.containers:
            podman("rm", "-f", "-t", "0", container, check=False)
        podman("network", "rm", "-f", self.network, check=False)

    def sh(self, host: str, command: str, check: bool = True) -> str:
        return podman("exec", self.name(host), "sh", "-c", command, check=check)

    def show(self, host: str, unit: str) -> dict[str, str]:
        """``systemctl show`` of ``unit`` in ``host``; empty while its systemd is not up."""
        out = self.sh(host, f"systemctl show {unit}", check=False)
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, host: str, unit: str) -> str:
        return self.sh(host, f"journalctl -u {unit} --no-pager -o cat", check=False)

    def ctl(self, *args: str) -> str:
        """coordinatorctl in the first coordinator's container, against this cluster."""
        argv = " ".join(f"'{a}'" for a in args)
        return self.sh("coord-0", f"RINGMASTER_NATS={self.nats_url} RINGMASTER_CLUSTER={CLUSTER} "
                       f"/opt/ringmaster/bin/coordinatorctl {argv}")  # fmt: skip

    def status(self) -> dict[str, Any]:
        return json.loads(self.ctl("status", "--json"))

    def events(self, *filters: str) -> list[dict[str, Any]]:
        out = self.ctl("tail", "--json", "--no-follow", *filters)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def restart_container(self, host: str) -> None:
        """A reboot: systemd inside stops every unit, and the container starts again."""
        podman("restart", "-t", "30", self.name(host))
