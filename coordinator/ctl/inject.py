"""``inject NODE FAULT``: simulated nodes only. Hardware faults go to the node's simulator
over NATS; process faults (``proto.faults.PROCESS_FAULTS``) are carried out here, on the
local cluster's files: ``kill-agent``, ``kill-worker``, ``lose-node`` and ``hang`` are
signals (the agent's PID is in the local cluster's ``pids/``, the ranks' in the agent's
run directory), ``restart-agent`` is a SIGKILL and the same agent started again
(``coordinator.ctl.spawn.restart_agent``), ``slow`` and ``nan-loss`` are knobs the node's
ranks read each step (``ringmaster.rundir.sim_knobs``). Network faults
(``proto.net_faults``) act on the namespaces of ``up --netns``
(``coordinator.ctl.netns_faults``). ``clear`` clears all: the simulator's faults, and
here the knobs, any rank left stopped by ``hang`` and the node's network faults."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from coordinator.ctl import netns_faults
from coordinator.ctl.bus import Session
from coordinator.ctl.errors import CtlError
from coordinator.ctl.home import agent_process, agent_run_dir, pid_file
from coordinator.ctl.spawn import restart_agent
from proto import subjects
from proto.api import InjectFault, InjectReply
from proto.codec import encode
from proto.faults import (
    ClearFault,
    Fault,
    HangFault,
    KillAgentFault,
    KillWorkerFault,
    LoseNodeFault,
    NanLossFault,
    RestartAgentFault,
    SimKnobs,
    SlowFault,
    parse_fault,
)
from proto.net_faults import NET_FAULTS
from proto.node import NodeRecord
from ringmaster import memory_store
from ringmaster.procs import pid_alive, read_pid
from ringmaster.rundir import LiveRank, job_ids, live_ranks, live_spares, sim_knobs


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
    if isinstance(fault, NET_FAULTS):
        return netns_faults.apply(home, node, fault)
    local = _local(fault, node, home)
    if local is not None:
        return local
    said = await _to_simulator(s, node, text)
    if isinstance(fault, ClearFault):
        _clear(node, home)
        said = "; ".join([said, *netns_faults.clear(home, node)])
    return said


def _local(fault: Fault, node: str, home: Path) -> str | None:
    """Carry out a process fault; None for the simulator's faults."""
    run_dir = agent_run_dir(home, node)
    match fault:
        case KillAgentFault():
            return _kill(_agent_pid(node, home), f"agent of {node}")
        case RestartAgentFault():
            return restart_agent(home, node)
        case KillWorkerFault():
            job, rank, pid = _ranks(node, run_dir)[0]
            return _kill(pid, f"{job} rank-{rank} on {node}")
        case LoseNodeFault():
            # The machine dies: the agent and every rank in the same instant, no goodbye.
            agent, ranks = _agent_pid(node, home), live_ranks(run_dir)
            spares = [s.pid for s in live_spares(run_dir)]
            for pid in (agent, *(r.pid for r in ranks), *spares):
                _signal(pid, signal.SIGKILL, quiet=True)
            gone = memory_store.remove_node(memory_store.SHM, node, job_ids(run_dir))  # its RAM
            said = f"lost {node}: killed its agent (pid {agent}) and {len(ranks)} rank(s)"
            return said + (f", dropped {len(gone)} memory snapshot store(s)" if gone else "")
        case HangFault(rank=want):
            ranks = _ranks(node, run_dir)
            chosen = [r for r in ranks if want is None or r.rank == want][:1]
            if not chosen:
                have = ", ".join(str(r.rank) for r in ranks)
                raise CtlError(f"no live rank {want} on {node} (it runs rank {have})", 2)
            job, rank, pid = chosen[0]
            _signal(pid, signal.SIGSTOP)
            return f"stopped {job} rank-{rank} on {node} (pid {pid}); 'clear' continues it"
        case SlowFault(factor=factor):
            knobs = _knobs(run_dir)
            knobs.slow = factor
            _write_knobs(run_dir, knobs)
            return f"{node}: ranks compute {factor:g}× slower"
        case NanLossFault():
            knobs = _knobs(run_dir)
            knobs.nan_loss += 1
            _write_knobs(run_dir, knobs)
            return f"{node}: the next step's loss will not be finite"
    return None


def _clear(node: str, home: Path) -> None:
    run_dir = agent_run_dir(home, node)
    sim_knobs(run_dir).unlink(missing_ok=True)
    for rank in live_ranks(run_dir):
        _signal(rank.pid, signal.SIGCONT, quiet=True)


def _agent_pid(node: str, home: Path) -> int:
    pid = read_pid(pid_file(home, agent_process(node)))
    if pid is None or not pid_alive(pid):
        raise CtlError(f"no live process for the agent of {node}")
    return pid


def _ranks(node: str, run_dir: Path) -> list[LiveRank]:
    ranks = live_ranks(run_dir)
    if not ranks:
        raise CtlError(f"no live training rank on {node}")
    return ranks


def _knobs(run_dir: Path) -> SimKnobs:
    """The node's knobs; a missing or unreadable file is the defaults (it is ours to
    rewrite). ``nan_loss`` keeps counting up, so ranks see each request as an increase."""
    try:
        return msgspec.json.decode(sim_knobs(run_dir).read_bytes(), type=SimKnobs)
    except (OSError, msgspec.DecodeError):
        return SimKnobs()


def _write_knobs(run_dir: Path, knobs: SimKnobs) -> None:
    path = sim_knobs(run_dir)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(msgspec.json.encode(knobs))
        tmp.replace(path)
    except OSError as exc:
        raise CtlError(f"cannot write {path}: {exc.strerror}") from None


def _signal(pid: int, sig: signal.Signals, *, quiet: bool = False) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        if not quiet:
            raise CtlError(f"process {pid} exited before it could be signalled") from None


async def _to_simulator(s: Session, node: str, text: str) -> str:
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
