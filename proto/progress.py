"""Messages between rank 0 of a job and its node agent (one JSON object per line over a
Unix socket), relayed to the coordinator as they arrive."""

from __future__ import annotations

import enum
import statistics
from collections.abc import Mapping
from typing import Literal

import msgspec


class ProgressBase(msgspec.Struct, tag_field="type", kw_only=True):
    job: str = ""
    step: int = 0
    time: float = 0.0
    # the attempt of the rank that sent it, stamped by its agent (0: unknown)
    attempt: int = 0


class StepDone(ProgressBase, tag="step"):
    loss: float = 0.0
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0  # the whole job's, this step
    target_steps: int = 0
    # Model FLOPs (forward + backward, 6N + attention) per token; None from older ranks.
    model_flops_per_token: float | None = None
    # Model FLOPs utilisation this step (a fraction of the devices' peak dense BF16 rate
    # times the world size); None where the device's peak is unknown (CPU).
    mfu: float | None = None
    # Set once per rank-0 process, on its second step: how much longer its first step took
    # than the second (compiling, or loading the compiled code from the node's cache).
    # None when the blocks are not compiled, and on every other StepDone.
    compile_s: float | None = None
    # The newest step sealed in the job's memory tier (rank 0's view); None: no tier.
    memory_step: int | None = None
    # The newest step rank 0 knows is durable, so a lost Checkpointed report costs the
    # coordinator's record one step, not a checkpoint interval; None: no checkpoint yet,
    # or a loop whose checkpoints Ringmaster does not see.
    durable_step: int | None = None


class Paused(ProgressBase, tag="paused"):
    pass


class Resumed(ProgressBase, tag="resumed"):
    pass


class Checkpointed(ProgressBase, tag="checkpointed"):
    path: str = ""
    stall_s: float = 0.0


class Finished(ProgressBase, tag="finished"):
    outcome: Literal["completed", "stopped"] = "completed"


class BandwidthChecked(ProgressBase, tag="bandwidth"):
    """The preflight bandwidth check (:mod:`trainer.preflight_bw`), once per rank-0 process
    of a multi-node job, before its first step."""

    # each node's bus bandwidth (NCCL-tests' busbw of its best link) in GB/s, by node id
    node_gbps: dict[str, float] = msgspec.field(default_factory=dict)
    median_gbps: float = 0.0
    # the nodes rank 0 found under the job's policy.min_bandwidth_ratio; the coordinator
    # decides again from node_gbps with the job's policy (slow_nodes)
    slow: list[str] = msgspec.field(default_factory=list)
    seconds: float = 0.0  # what the check cost


class Rewound(ProgressBase, tag="rewound"):
    """Every rank went back to the checkpoint of step ``step`` after a numeric fault at
    ``from_step``; the data of steps [skip_from, skip_to) will be skipped."""

    from_step: int = 0
    skip_from: int = 0
    skip_to: int = 0
    reason: str = ""
    # the ranks whose own loss was not finite in the faulting step, as every rank found
    # together, the lowest RANKS_SAID of them; empty where none was (a gradient-norm
    # explosion) or the loop does not say; ``nonfinite``: how many in all
    ranks: list[int] = msgspec.field(default_factory=list)
    nonfinite: int = 0


RANKS_SAID = 64  # a report names at most this many ranks: a node has fewer


class Stragglers(ProgressBase, tag="stragglers"):
    """Rank 0's view of each rank's compute seconds per step (before any collective),
    medians over the last ``window_steps`` steps, by rank."""

    rank_step_s: list[float] = msgspec.field(default_factory=list)
    window_steps: int = 0


class Reaction(enum.StrEnum):
    """What a job's training loop can do when the coordinator decides it, as the loop says
    when it opens the rank API (:mod:`ringmaster.rank`). A loop that never opens it (an
    unmodified script) has none of them: it can only be started, killed and restarted."""

    PAUSE = "pause"  # hold every rank at one agreed step boundary, no rank in a collective
    CHECKPOINT = "checkpoint"  # a durable checkpoint at one agreed step, on request
    MEMORY_TIER = "memory tier"  # snapshots in RAM, restored a few steps back after a fault
    HANG_BY_BEAT = "hang by beat"  # every rank beats: a stall is found, the culprit named


class LoopReady(ProgressBase, tag="loop"):
    """Rank 0 opened the rank API: which framework drives the loop, what it supports, and
    where this attempt resumed (``step``; ``resumed_from``: ``memory``, ``durable`` (the
    API's checkpoint), ``loop`` (the framework's own checkpoint) or ``fresh``)."""

    framework: str = "custom"
    reactions: list[Reaction] = msgspec.field(default_factory=list)
    resumed_from: str = ""


class PhaseChanged(ProgressBase, tag="phase"):
    """Every rank entered (``entered``) or left a named stretch without steps (evaluation,
    data loading, the loop's own saving), as rank 0 says; ``bound_s`` is how long it may
    take before the hang watch judges it stalled (None: the job's hang threshold), and a
    phase left says how long it took (``seconds``)."""

    name: str = ""
    entered: bool = True
    bound_s: float | None = None
    seconds: float = 0.0


Progress = (
    StepDone
    | Paused
    | Resumed
    | Checkpointed
    | Finished
    | BandwidthChecked
    | Rewound
    | Stragglers
    | LoopReady
    | PhaseChanged
)


def slow_nodes(node_gbps: Mapping[str, float], ratio: float) -> dict[str, float]:
    """The nodes under ``ratio`` × the median of their peers' figures, each with that
    median. Shared by rank 0 (its log) and the coordinator (its decision)."""
    slow = {}
    for node, gbps in node_gbps.items():
        peers = [g for n, g in node_gbps.items() if n != node]
        if peers and gbps < ratio * (median := statistics.median(peers)):
            slow[node] = median
    return slow


class ControlAction(enum.StrEnum):
    """What a control word asks: the one spelling of the four actions. The agent's commands
    are tagged with them (``proto.commands``), the agent sends them and the trainer codes
    them for its step all-reduce (``ringmaster.rank.control.Action``)."""

    PAUSE = "pause"
    RESUME = "resume"
    CHECKPOINT = "checkpoint"
    STOP = "stop"


class ControlWord(msgspec.Struct, kw_only=True):
    """Agent → rank 0: what to do at the next step boundary."""

    action: ControlAction
    seq: int = 0
