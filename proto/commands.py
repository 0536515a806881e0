"""Commands from the leading coordinator to node agents, and the agents' replies.

Every command carries the leader's ``epoch`` (its lease revision). An agent remembers the
newest epoch it has seen and refuses anything older (fencing): a deposed leader that has
not noticed yet cannot give orders.
"""

from __future__ import annotations

import msgspec

from proto.job import JobSpec
from proto.progress import ControlAction


class CommandBase(msgspec.Struct, tag_field="command", kw_only=True):
    epoch: int = 0  # stamped by the coordinator's commander just before sending
    issued_by: str = ""
    job: str = ""


class RankSpec(msgspec.Struct, kw_only=True):
    rank: int
    local_rank: int
    cpus: list[int] = msgspec.field(default_factory=list)


class Launch(CommandBase, tag="launch"):
    """Start this node's ranks of a job. ``env`` is torchrun's contract plus the job's."""

    ranks: list[RankSpec]
    spec: JobSpec
    argv: list[str] = msgspec.field(default_factory=list)  # empty: the built-in trainer
    env: dict[str, str] = msgspec.field(default_factory=dict)
    workdir: str = ""
    attempt: int = 0
    pre_start: str | None = None
    # the job's other nodes, each as host:port of its peer-probe listener: this node
    # probes them while it runs the job's ranks (nodeagent.peer_probe)
    peers: dict[str, str] = msgspec.field(default_factory=dict)


class Pause(CommandBase, tag=ControlAction.PAUSE.value):
    reason: str = ""


class Resume(CommandBase, tag=ControlAction.RESUME.value):
    reason: str = ""


class CheckpointNow(CommandBase, tag=ControlAction.CHECKPOINT.value):
    reason: str = ""


class Stop(CommandBase, tag=ControlAction.STOP.value):
    """Stop the job's ranks at the next step boundary (graceful), or kill them now."""

    reason: str = ""
    force: bool = False
    grace_s: float = 10.0
    # Only ranks of this attempt or an earlier one (0: whatever attempt the node runs): a
    # stop of an orphan must never reach the attempt launched after it.
    attempt: int = 0


class ResyncClock(CommandBase, tag="resync_clock"):
    pass


class ReservePort(CommandBase, tag="reserve_port"):
    """Ask the master node for a free TCP port for the rendezvous store."""


class Ping(CommandBase, tag="ping"):
    """Are you there? Sent to a job's nodes when one of its ranks fails, so a node whose
    agent is gone is left out of the restart at once instead of after missed beats."""


Command = Launch | Pause | Resume | CheckpointNow | Stop | ResyncClock | ReservePort | Ping


class CommandReply(msgspec.Struct, kw_only=True):
    ok: bool
    error: str = ""
    node: str = ""
    epoch_seen: int = 0
    port: int = 0
    pids: list[int] = msgspec.field(default_factory=list)
    # the agent's wall clock when it answered (0: not said): a beat it sent later is newer
    # than this answer, whatever order the two reach the coordinator in
    sent_at: float = 0.0
    # when the answering agent process started (its beats' ``started_at``; 0: not said): a
    # beat of a later process was built after this answer
    started_at: float = 0.0
    # False: nobody answered (no agent subscribed, or none in time); set by the sender
    answered: bool = True
