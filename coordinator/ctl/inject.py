"""``inject NODE FAULT``: simulated nodes only. Hardware faults go to the node's simulator
over NATS; ``kill-agent`` and ``kill-worker`` are signals to local processes whose PIDs the
local cluster keeps."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from coordinator.ctl.bus import Session
from coordinator.ctl.errors import CtlError
from coordinator.ctl.home import pid_alive, read_pid
from nodeagent.sim.faults import KillAgentFault, KillWorkerFault, parse_fault
from proto import subjects
from proto.api import InjectFault, InjectReply
from proto.codec import encode
from proto.node import NodeRecord


async def inject(s: Session, node: str, text: str, home: Path) -> str:
    try:
        fault = parse_fault(text)
    except ValueError as exc:
        raise CtlError(str(exc), code=2) from None
    record = await s.record("nodes", node, NodeRecord)
    if record is None:
        raise CtlError(f"no node {node!r} in cluster {s.cluster!r}", code=2)
    if not record.simulated:
        raise CtlError(f"node {node} is real hardware: inject works on simulated nodes only", 2)
    match fault:
        case KillAgentFault():
            return _kill(home / "pids" / f"nodeagent-{node}.pid", f"agent of {node}")
        case KillWorkerFault():
            ranks = sorted((home / "nodes" / node / "agent" / "jobs").glob("*/rank-*.pid"))
            for pidfile in ranks:
                pid = read_pid(pidfile)
                if pid is not None and pid_alive(pid):
                    return _kill(pidfile, f"{pidfile.parent.name} {pidfile.stem} on {node}")
            raise CtlError(f"no live training rank on {node}")
    try:
        msg = await s.nc.request(
            subjects.sim(s.cluster, node), encode(InjectFault(fault=text)), timeout=5
        )
    except NoRespondersError:
        raise CtlError(f"the simulator of {node} is not answering") from None
    except (NatsTimeout, TimeoutError):
        raise CtlError(f"the simulator of {node} did not answer within 5 s") from None
    try:
        reply = msgspec.json.decode(msg.data, type=InjectReply)
    except msgspec.DecodeError as exc:
        raise CtlError(f"bad reply from the simulator: {exc}") from None
    if not reply.ok:
        raise CtlError(reply.error, code=2)
    return f"{node}: active faults: {', '.join(reply.faults) or 'none'}"


def _kill(pidfile: Path, what: str) -> str:
    pid = read_pid(pidfile)
    if pid is None or not pid_alive(pid):
        raise CtlError(f"no live process for the {what}")
    os.kill(pid, signal.SIGKILL)
    return f"killed the {what} (pid {pid})"
