"""``inject NODE FAULT``: simulated nodes only. Hardware faults go to the node's simulator
over NATS; ``kill-agent`` and ``kill-worker`` are signals to local processes: the agent's
PID is in the local cluster's ``pids/``, the ranks' in the agent's run directory."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from coordinator.ctl.bus import Session
from coordinator.ctl.errors import CtlError
from coordinator.ctl.home import agent_process, agent_run_dir, pid_file
from proto import subjects
from proto.api import InjectFault, InjectReply
from proto.codec import encode
from proto.faults import KillAgentFault, KillWorkerFault, parse_fault
from proto.node import NodeRecord
from ringmaster.procs import pid_alive, read_pid
from ringmaster.rundir import live_ranks


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
            pid = read_pid(pid_file(home, agent_process(node)))
            if pid is None or not pid_alive(pid):
                raise CtlError(f"no live process for the agent of {node}")
            return _kill(pid, f"agent of {node}")
        case KillWorkerFault():
            ranks = live_ranks(agent_run_dir(home, node))
            if not ranks:
                raise CtlError(f"no live training rank on {node}")
            job, rank, pid = ranks[0]
            return _kill(pid, f"{job} rank-{rank} on {node}")
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


def _kill(pid: int, what: str) -> str:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        raise CtlError(f"the {what} exited before it could be killed") from None
    return f"killed the {what} (pid {pid})"
