"""Slurm, through its own commands: the allocation a job runs in (``scontrol show
hostnames``), the nodes' drain state and reasons (``sinfo``), drains and their lifting
(``scontrol update``), requeue (``scontrol requeue``).

Only the commands an administrator would type, never Slurm's files or sockets: whatever
Slurm version and configuration the site runs, these answer the same, and a failure
carries Slurm's own message. Each call is retried a few times with jittered backoff (a
busy ``slurmctld`` answers late, a restarting one not at all) and then raises
:class:`SlurmError` for the caller to warn about: Slurm being away is never a reason to
stop a healthy job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ringmaster.retry import retrying

# Every drain reason Ringmaster sets starts with this; only such drains are ever lifted.
PREFIX = "ringmaster:"
# ``coordinatorctl start --wait``'s exit status for "requeue me": the job stopped at a
# checkpoint because its allocation is ending (a preemption or time-limit signal) or lost
# a node it cannot continue without; the next allocation resumes from that checkpoint.
# 75 is sysexits' EX_TEMPFAIL ("try again later"); slurm.conf's RequeueExit=75 requeues
# on it without any script.
REQUEUE_EXIT = 75
TIMEOUT_S = 15.0  # one command's limit
ATTEMPTS = 3
DEFAULT_CONF = Path("/etc/slurm/slurm.conf")


class SlurmError(Exception):
    """A Slurm command failed; the message is its own (or why it could not run)."""


@dataclass(frozen=True)
class Allocation:
    """The Slurm job a process runs in: its id, its nodes' names, how often it was
    requeued (``SLURM_RESTART_COUNT``)."""

    job_id: str
    hosts: list[str]
    restarts: int = 0


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str  # sinfo's long state, e.g. "idle", "drained", "draining", "down*"
    reason: str  # "" when none

    @property
    def drained(self) -> bool:
        """Drained or draining: Slurm places no new work there."""
        return "drain" in self.state

    @property
    def ours(self) -> bool:
        return self.reason.startswith(PREFIX)


def available(env: Mapping[str, str] = os.environ) -> bool:
    """Slurm's commands are installed and a configuration for them is there."""
    conf = Path(env["SLURM_CONF"]) if env.get("SLURM_CONF") else DEFAULT_CONF
    return shutil.which("scontrol") is not None and conf.is_file()


def run(argv: list[str], attempts: int = ATTEMPTS) -> str:
    """Run a Slurm command; its stdout. Retried; then :class:`SlurmError`."""
    for attempt in retrying((SlurmError,), first_s=0.2, cap_s=2.0, attempts=attempts):
        with attempt:
            return _once(argv)
    raise AssertionError("unreachable: retrying re-raises the last failure")


def _once(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]}: not installed") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv[:3])}: no answer in {TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        why = said[-1] if said else f"exit status {done.returncode}"
        raise SlurmError(f"{' '.join(argv[:3])}: {why}")
    return done.stdout


def allocation(env: Mapping[str, str] = os.environ) -> Allocation | None:
    """The allocation this process runs in (None outside one): ``SLURM_JOB_ID`` and
    ``SLURM_JOB_NODELIST``, the list expanded by ``scontrol show hostnames``."""
    job_id, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
    if not job_id or not nodelist:
        return None
    hosts = run(["scontrol", "show", "hostnames", nodelist]).split()
    if not hosts:
        raise SlurmError(f"SLURM_JOB_NODELIST={nodelist!r} names no node")
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return Allocation(job_id, hosts, int(restarts) if restarts.isdigit() else 0)


def nodes() -> dict[str, SlurmNode]:
    """Every node Slurm knows, with its state and reason (a node in several partitions
    is listed once)."""
    out = run(["sinfo", "--noheader", "--Node", "--format=%N|%T|%E"])
    return parse_nodes(out)


def parse_nodes(text: str) -> dict[str, SlurmNode]:
    found = {}
    for line in text.splitlines():
        name, sep, rest = line.strip().partition("|")
        if not sep or not name:
            continue
        state, _, reason = rest.partition("|")  # the reason is last: it may hold "|"
        reason = "" if reason.strip() in ("none", "(null)") else reason.strip()
        found[name] = SlurmNode(name, state.strip().lower(), reason)
    return found


def drain(node: str, reason: str) -> None:
    run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])


def lift(node: str) -> None:
    run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])


def requeue(job_id: str) -> None:
    run(["scontrol", "requeue", job_id])


# Slurm job states in which the allocation still holds its nodes
HOLDING = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "CONFIGURING", "RESIZING", "STOPPED"})


def job_state(job_id: str) -> str:
    """The Slurm job's state (``RUNNING``, ``CANCELLED``, ``PENDING`` once requeued …);
    ``GONE`` once Slurm no longer knows it (purged after ``MinJobAge``)."""
    try:
        return _job_field(job_id, "JobState")
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return "GONE"
        raise


def restarts(job_id: str) -> int:
    """How many times Slurm has requeued the job (its ``Restarts``): by ``scontrol
    requeue``, or by itself on a preemption with ``PreemptMode=REQUEUE``."""
    value = _job_field(job_id, "Restarts")
    if not value.isdigit():
        raise SlurmError(f"scontrol show job {job_id}: Restarts={value!r} is not a count")
    return int(value)


def _job_field(job_id: str, name: str) -> str:
    fields = job_fields(job_id)
    if name not in fields:
        raise SlurmError(f"scontrol show job {job_id}: no {name} in its answer")
    return fields[name]


def job_fields(job_id: str) -> dict[str, str]:
    """Slurm's record of the job (``scontrol show job``) as field → value (those without
    spaces in their value: state, reason, counts and times)."""
    out = run(["scontrol", "show", "job", "--oneliner", job_id])
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


# What Slurm's SIGTERM to a batch step means, read from its record of the job at that
# moment (scontrol show job); measured on slurm-wlm 22.05:
#   scancel JOBID              JobState=COMPLETING Reason=None, Restarts as before
#   the time limit             JobState=COMPLETING Reason=TimeLimit
#   preempted, PreemptMode=REQUEUE   Restarts already one more than the run's
#   scancel --signal=TERM      JobState=RUNNING (a signal only: the job goes on)
CANCEL, END = "cancel", "end"


def ending(signal_name: str, fields: dict[str, str], run_restarts: int) -> tuple[str, str]:
    """(CANCEL or END, why) for Slurm's signal to the batch step: CANCEL when the job was
    cancelled (``scancel``: stop it, no requeue), END when its allocation ends and it is to
    come back (the warning before the time limit, the limit itself, a preemption), and
    for a signal Slurm's record does not explain (the job is still running)."""
    if signal_name != "SIGTERM":
        return END, f"Slurm sent {signal_name}: the allocation ends (time limit or preemption)"
    state, reason = fields.get("JobState", ""), fields.get("Reason", "")
    restarts = fields.get("Restarts", "")
    if restarts.isdigit() and int(restarts) > run_restarts:
        return END, "Slurm sent SIGTERM: requeued by Slurm (a preemption)"
    if state in ("TIMEOUT", "DEADLINE") or reason in ("TimeLimit", "Deadline"):
        return END, "Slurm sent SIGTERM: the time limit"
    preempted = fields.get("PreemptTime", "None") not in ("None", "Unknown", "")
    if state == "PREEMPTED" or preempted:
        return END, "Slurm sent SIGTERM: a preemption"
    if state in ("CANCELLED", "COMPLETING"):
        return CANCEL, "Slurm sent SIGTERM: the job was cancelled (scancel)"
    return END, f"Slurm sent SIGTERM: the allocation ends ({state or 'state unknown'})"
