"""The job file (config: unknown keys are errors) and the job record kept in KV (wire)."""

from __future__ import annotations

import enum
import re
from typing import Annotated, Literal

import msgspec

from proto.progress import Reaction
from proto.recurrence import NumericFault

Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")]
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


def safe_name(name: str) -> str:
    """``name`` as one path component: anything but letters, digits, ``_.-`` is ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def shm_staging_name(job_id: str) -> str:
    """The directory under ``/dev/shm`` where a job's ranks stage checkpoints in RAM; the
    agent removes it once every rank of the job on its node has exited."""
    return "ringmaster-" + safe_name(job_id)


MEMORY_STORE_PREFIX = "ringmaster-mem-"


def memory_store_name(job_id: str) -> str:
    """The directory under ``/dev/shm`` holding a job's memory tier (one subdir per
    node, :mod:`ringmaster.memory_store`); it outlives the job's ranks, and the agent
    removes its node's part once every rank of the job there has exited cleanly."""
    return MEMORY_STORE_PREFIX + safe_name(job_id)


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of job-file sections: a typo in a key is an error, not a silent default."""


class JobSection(Config):
    name: Name  # required; letters, digits, "_" and "-", up to 63
    nodes: Positive = 1  # nodes the job runs on
    gpus_per_node: Positive = 1  # ranks per node (worker processes on CPU)
    # A user's own torch script, run under the torchrun environment instead of the
    # built-in trainer (argv; the first element is resolved relative to the job file).
    # Unset: the built-in trainer.
    entry: list[str] | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)  # extra environment of every rank
    # A script every node runs after its GPUs are up and before its ranks start (warm-up,
    # cache priming); a non-zero exit fails that launch. Relative to the job file; unset:
    # none.
    pre_start: str | None = None
    pre_start_timeout_s: PositiveFloat = 300.0  # s; a pre_start still running then fails
    # Data-parallel jobs may continue on fewer nodes, down to this many, when a node is
    # lost and no healthy one can replace it (and grow back later). Unset: ``nodes``.
    min_nodes: Positive | None = None
    # Healthy nodes held for this job beyond ``nodes``, ready to replace a lost one.
    spares: NonNegative = 0

    def __post_init__(self) -> None:
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"job.min_nodes = {self.min_nodes} exceeds job.nodes = {self.nodes}")


class TrainSection(Config):
    # the built-in trainer's preset: tiny, small, 125m, 350m, 1b3, 3b (trainer/presets.py)
    model: str = "tiny"
    steps: Positive = 200  # optimizer steps to train
    precision: Literal["fp8", "bf16", "fp32"] = "fp8"  # fp8 is emulated on CPU
    # float8 scaling (precision = "fp8" only): "auto" picks, per block linear, tensorwise
    # (one scale per tensor), rowwise (one per row) or high precision, by what pays for its
    # shape; "tensorwise" or "rowwise" use that scaling for every block linear.
    fp8_recipe: Literal["auto", "tensorwise", "rowwise"] = "auto"
    # torch.compile each transformer block, with a node-local cache of the compiled code;
    # unset: on with CUDA, off on CPU.
    compile: bool | None = None
    # Recompute each block in backward instead of keeping its activations; unset: on with
    # CUDA for models of a billion parameters and more.
    activation_checkpointing: bool | None = None
    micro_batch_size: Positive = 4  # sequences per rank per step
    # On CUDA: start at micro_batch_size and halve until a step fits in free GPU memory.
    auto_micro_batch: bool = False
    seq_len: Positive = 128  # tokens per sequence
    # "synthetic", or a .bin file of uint16 tokens (trainer.tokenize; relative to the
    # job's working directory) read through memmap
    data: str = "synthetic"
    lr: PositiveFloat = 3e-4  # peak learning rate
    grad_clip: PositiveFloat = 1.0  # gradient-norm clipping
    seed: NonNegative = 0  # initial weights and the order of the data
    # deepspeed (ZeRO, zero_stage below), fsdp (FSDP2, torch.distributed.checkpoint), or
    # plain ddp.
    engine: Literal["deepspeed", "fsdp", "ddp"] = "deepspeed"
    zero_stage: Annotated[int, msgspec.Meta(ge=0, le=3)] = 1  # ZeRO stage (deepspeed only)
    log_every: Positive = 1  # steps between rank 0's progress reports
    # Multi-node jobs: time an all-reduce over each link between nodes before the first
    # step and refuse a node under policy.min_bandwidth_ratio (trainer/preflight_bw.py).
    preflight_bandwidth: bool = True


class CheckpointSection(Config):
    every_steps: Positive = 50  # steps between periodic checkpoints
    dir: str = "checkpoints"  # the durable directory (relative: to the job's working dir)
    keep: Positive = 3  # durable checkpoints kept; older ones are pruned
    # where ranks stage a checkpoint before it is copied to ``dir``; unset: a per-job
    # directory in /dev/shm (RAM) when writable, else under the working directory
    staging_dir: str | None = None
    # The memory tier: recent snapshots in the RAM of the rank's node and of a buddy
    # rank's on the next node, restored after a fault instead of the durable checkpoint
    # when newer. Never written to ``dir``.
    memory_tier: bool = True
    # Steps between memory snapshots; unset: as few as keep a snapshot's blocking time
    # under 2 % of step time (measured by the ranks, at most every_steps).
    memory_every_steps: Positive | None = None


class PolicySection(Config):
    """How the job reacts to what is found, decided by the coordinator (and, for the hang
    and numeric keys, by the agent's hang watch and the trainer, which read this spec).
    What opens and closes a condition on a node (NVMe latency, GPU temperature, clock
    offset, PCIe, topology) is the node agent's to judge, in its own config
    (nodeagent/config.py), and missed heartbeats the coordinator's (Registry): the policy
    acts on the condition and the severity the agent gave it."""

    # ms. After a resync the agent judged failed, the node is drained only if the offset
    # it measured is still beyond this; the agent's clock.max_offset_ms opens the drift.
    clock_max_offset_ms: PositiveFloat = 5.0
    # Restarts in a row without the job training past the step it failed at: a job that
    # keeps failing at the same place (a crash loop) fails; faults far apart, each one
    # trained past, never exhaust it.
    max_restarts: NonNegative = 3
    # The preflight bandwidth check refuses a node whose bus bandwidth is under this
    # fraction of the median of its peers' (three nodes and more).
    min_bandwidth_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    # s; a job that cannot run (too few healthy nodes) fails after waiting this long.
    wait_for_nodes_s: PositiveFloat = 600.0
    # A node left out after a fault is eligible again after this many seconds (twice as
    # long each time it faults again soon after), or once its agent restarts healthy.
    exclude_s: PositiveFloat = 300.0
    # A rank is hung when it makes no progress for max(hang_step_factor × its median
    # step time, hang_floor_s seconds) outside start-up, checkpoints and pauses; the
    # agent's hang watch reads both from the job's spec.
    hang_step_factor: PositiveFloat = 3.0
    hang_floor_s: PositiveFloat = 3.0
    # A straggler: its median compute time per step over straggler_window_steps steps is
    # over straggler_ratio × the median of its peers', in two windows in a row.
    straggler_ratio: Annotated[float, msgspec.Meta(gt=1)] = 1.5
    straggler_window_steps: Annotated[int, msgspec.Meta(ge=3)] = 20
    # s; the shortest preemption notice the job's nodes may get (AWS spot 120 s, GCP and
    # Azure 30 s); unset: none expected. When a measured checkpoint takes longer, the job
    # is at risk ahead of any notice: it says so (job.at_risk) and checkpoints every
    # max(notice, checkpoint time) seconds, so a notice costs at most that much work.
    preemption_notice_s: PositiveFloat | None = None
    # Numeric faults (non-finite loss, gradient-norm explosion) rewind to the newest good
    # checkpoint. One that comes back (within a checkpoint interval of steps, or on the
    # same data) is rewound at most this many times: then, if its every return was on one
    # node's ranks alone, that node is held and the job goes on without it, else the job
    # fails with the evidence. The same holds for one node's faults within an hour, near
    # or far apart. Faults far apart on different nodes each start afresh.
    max_rewinds: NonNegative = 2
    # A gradient norm over this many times the median of the recent steps' is an
    # explosion (the trainer judges it).
    grad_norm_spike: Annotated[float, msgspec.Meta(gt=1)] = 50.0


class AlertsSection(Config):
    # Slack-compatible incoming webhook for this job's critical events and its end, in
    # addition to the coordinator's own (coordinator/alerts.py). Empty: none.
    webhook_url: Annotated[str, msgspec.Meta(pattern=r"^(https?://\S+)?$")] = ""


class JobSpec(Config):
    """The job file; every key, its unit, default and owner: docs/jobfile.md."""

    job: JobSection
    train: TrainSection = msgspec.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = msgspec.field(default_factory=CheckpointSection)
    policy: PolicySection = msgspec.field(default_factory=PolicySection)
    alerts: AlertsSection = msgspec.field(default_factory=AlertsSection)


class JobState(enum.StrEnum):
    """Job lifecycle: pending → starting → running ⇄ paused | checkpointing; live →
    recovering → starting; → completed | failed | stopped (terminal). Every transition is
    a row of ``coordinator.job_machine.TABLE``, the only code that changes a job's state
    (docs/architecture.md lists the rows)."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    CHECKPOINTING = "checkpointing"
    RECOVERING = "recovering"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED)


GOODPUT_BUCKETS = (
    "productive",
    "startup",
    "paused",
    "checkpoint_stall",
    "recovery",
    "lost_work",
    "idle",
    # running time of a loop that reports no steps (a script that does not open the rank
    # API): training and redone work cannot be told apart there
    "unknown",
)


class Failure(msgspec.Struct, kw_only=True):
    """What failed, as the restart budget compares failures (coordinator.job_machine):
    the node, the rank (None: the whole node), how (``exit 1``, ``signal 9``, ``hang``,
    ``node lost`` …) and the step the job had reached."""

    node: str
    rank: int | None = None
    cause: str = ""
    step: int = 0


class Allocation(msgspec.Struct, kw_only=True):
    """The scheduler's allocation a job was started in (``start`` inside ``sbatch`` or
    ``salloc``): the job runs on these hosts only, the ones it does not use held as
    spares. ``restarts``: how often the scheduler requeued it."""

    scheduler: Literal["slurm"] = "slurm"
    job_id: str
    hosts: list[str]
    restarts: int = 0

    def __str__(self) -> str:
        times = {0: "", 1: ", requeued once"}.get(
            self.restarts, f", requeued {self.restarts} times"
        )
        return f"Slurm job {self.job_id} ({', '.join(self.hosts)}{times})"


class Exclusion(msgspec.Struct, kw_only=True):
    """A node left out of a job after a fault, and until when (wall time). It is eligible
    again after ``until``, or sooner once its agent starts anew (``agent_started_at``
    changes) and reports healthy. ``count``: exclusions in a row, each one twice as long
    (a node that faults again soon after it came back)."""

    reason: str
    since: float
    until: float
    count: int = 1
    agent_started_at: float = 0.0


class LoopInfo(msgspec.Struct, kw_only=True):
    """What the job's training loop said when it opened the rank API (``LoopReady``):
    the framework driving it and the reactions it supports, in the attempt it said so."""

    framework: str = ""
    reactions: list[Reaction] = msgspec.field(default_factory=list)
    attempt: int = 0


class LoopPhase(msgspec.Struct, kw_only=True):
    """A named stretch without steps the ranks are in (``PhaseChanged``): since when (rank
    0's stamp) and for how long it may last (None: the job's hang threshold)."""

    name: str
    since: float
    bound_s: float | None = None


class HeldHang(msgspec.Struct, kw_only=True):
    """A ``worker.hung`` without a culprit whose verdict waits, kept with the job so a new
    leader gives it: who reported it, in which attempt, and until when (wall time)."""

    node: str
    rank: int
    attempt: int
    step: int = 0
    evidence: str = ""
    until: float = 0.0


class GivenUp(msgspec.Struct, kw_only=True):
    """The attempt a relaunch replaced, until the new one trains: its rank 0's steps may
    still arrive (a loaded node relays them late), and the ledger counts them."""

    attempt: int
    node: str  # its rank 0's, the only one that speaks for its steps
    world_size: int


class JobRecord(msgspec.Struct, kw_only=True):
    """What the coordinator keeps for a job in KV; ``status JOB --json`` prints it."""

    id: str
    name: str
    spec: JobSpec
    workdir: str = ""
    state: JobState = JobState.PENDING
    step: int = 0
    target_steps: int = 0
    # where the first attempt resumes, as ``start`` found it: the newest checkpoint's step
    # and the job that wrote it (None: a fresh start)
    resume_step: int | None = None
    resume_job: str = ""
    allocation: Allocation | None = None  # the scheduler's, when started inside one
    # it ended at a checkpoint because its allocation ends or cannot carry it on: the
    # scheduler should requeue it (``start --wait`` exits with ringmaster.slurm's code)
    requeue: bool = False
    restarts: int = 0
    pauses: int = 0
    last_checkpoint_step: int | None = None
    # the newest step in the job's memory tier, as rank 0 last said (None: none)
    memory_step: int | None = None
    world_size: int = 0
    nodes: list[str] = msgspec.field(default_factory=list)
    master_addr: str = ""
    master_port: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None  # rank 0's newest step, all ranks together
    mfu: float | None = None  # model FLOPs utilisation, a fraction; None: peak unknown
    # seconds rank 0's latest start spent compiling (or loading compiled code from the
    # node's cache) before its first step; counted in the startup or recovery bucket
    compile_s: float | None = None
    reason: str = ""
    # keys (proto.conditions.condition_key) of the conditions holding the job paused
    pause_reasons: list[str] = msgspec.field(default_factory=list)
    attempt: int = 0
    stopping: bool = False
    finished: str = ""  # rank 0's own word on how training ended: completed | stopped
    # nodes left out after a fault, by node; an entry stays after it ends (``until`` in the
    # past) so that a node that faults again soon is left out for longer (backoff)
    excluded: dict[str, Exclusion] = msgspec.field(default_factory=dict)
    spare_nodes: list[str] = msgspec.field(default_factory=list)  # held for it ([job] spares)
    failed_at_step: int = 0  # the step reached before the last restart (for lost_work)
    rewinds: int = 0  # numeric faults the job went back from (job.rewound), all of them
    # the recent numeric faults the rewind budget compares (coordinator.numeric_policy):
    # the last hour's, at most numeric_policy.KEEP
    numeric_faults: list[NumericFault] = msgspec.field(default_factory=list)
    # seconds the newest periodic checkpoint took from its step to durable
    checkpoint_s: float | None = None
    # when the coordinator last asked for a checkpoint to bound a preemption's cost
    bounding_checkpoint_at: float | None = None
    # charged restarts since the job last trained past the step it failed at (the budget),
    # and the furthest step those failures had reached
    restarts_in_row: int = 0
    failing_at_step: int = 0
    last_failure: Failure | None = None  # the newest failure the budget counted
    # the attempt whose ranks are being stopped before the next launch (0: none): the
    # next attempt launches only once its stop is done (coordinator.job_machine)
    stopping_attempt: int = 0
    stop_graceful: bool = False  # that stop lets the ranks checkpoint at a boundary first
    given_up: GivenUp | None = None  # the attempt before the current one, until it trains
    # when the ranks of each node hung (worker.hung), the last hour's: a node whose ranks
    # hang twice within it is left out (coordinator.policy)
    hung_at: dict[str, list[float]] = msgspec.field(default_factory=dict)
    # a hang no node could pin, waiting for the network's word (coordinator.hang_verdict)
    held_hang: HeldHang | None = None
    # since when the job has waited for enough healthy nodes (policy.wait_for_nodes_s)
    waiting_since: float | None = None
    exited_ranks: dict[str, int] = msgspec.field(default_factory=dict)
    submitted_at: float = 0.0
    started_at: float | None = None
    attempt_started_at: float | None = None  # when the current attempt launched
    first_step_at: float | None = None
    last_step_at: float | None = None  # when rank 0 finished its newest step (its stamp)
    step_s: float | None = None  # recent wall seconds per step (a running average)
    finished_at: float | None = None
    updated_at: float = 0.0
    accounted_at: float = 0.0
    goodput: dict[str, float] = msgspec.field(default_factory=dict)
    # GPU-s the ledger charged as recovery since the newest step for want of a step: a
    # late report can show the ranks were stepping all along (coordinator.goodput)
    stalled_gpu_s: float = 0.0
    # what the loop said it supports (None: it has said nothing: the built-in trainer
    # before its first word, or a script that never opens the rank API)
    loop: LoopInfo | None = None
    # the named phase the ranks are in, and GPU-s spent in each named phase so far (part
    # of the ledger: out of productive, under the phase's own name)
    phase: LoopPhase | None = None
    phases: dict[str, float] = msgspec.field(default_factory=dict)
    # keys of open conditions the job's loop could not react to (a pause its loop cannot
    # take): said once, in ``job.unheeded``, and cleared when the condition closes
    unheeded: list[str] = msgspec.field(default_factory=list)
