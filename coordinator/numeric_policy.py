"""Numeric faults judged by recurrence: the rewind budget. Pure: the job, rank 0's report
of a rewind (:class:`proto.progress.Rewound`) and ``now`` in, actions out.

The ranks rewind by themselves at every numeric fault (``trainer.numeric``); the
coordinator decides whether training may go on that way. Each fault is kept with the one
node its non-finite ranks were on, if they were on one alone (:func:`suspect`), for an
hour (:data:`coordinator.node_life.REPEAT_WINDOW_S`, the window of a node's repeats).
Then, with ``policy.max_rewinds`` as the budget:

- one node's ranks alone non-finite in more faults of that hour than the budget, near or
  far apart, while the others' were not: the node computes wrong numbers (silent data
  corruption, failing device memory). It is held for a person
  (:func:`coordinator.node_verbs.hold`) and the job goes on without it, from its newest
  checkpoint, uncharged (the job did not fail, the node did); its faults are spent.
- a run of more faults than the budget, each the one before coming back
  (:func:`proto.recurrence.recurring`: within a checkpoint interval of steps, or on the
  same data), on several nodes, every node or none: the model or the data fail wherever
  they run, and the job fails with the run as the evidence.
- anything else: the rewind stands. A fault far from the last one starts afresh, so a job
  that runs for weeks is not failed by its fourth unrelated fault.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.actions import Action, FinishJob, HoldNode, RestartJob
from coordinator.node_life import REPEAT_WINDOW_S, at
from coordinator.reconcile import host_of
from proto.job import Failure, JobRecord, JobState
from proto.progress import Rewound
from proto.recurrence import NumericFault, recurring, same_place_steps

KEEP = 32  # faults kept on the job's record at most: the decisions need a budget's worth


def seen(job: JobRecord, msg: Rewound, now: float) -> NumericFault:
    """The fault rank 0 reported, as the budget compares faults, kept on the job's record
    with the last hour's."""
    fault = NumericFault(
        step=msg.from_step,
        position=msg.skip_to - 1 if msg.skip_to > msg.skip_from else None,
        node=suspect(job, msg.ranks) if msg.nonfinite <= len(msg.ranks) else "",
        reason=msg.reason,
        at=now,
    )
    kept = [f for f in job.numeric_faults if now - f.at <= REPEAT_WINDOW_S]
    job.numeric_faults = [*kept, fault][-KEEP:]
    return fault


def suspect(job: JobRecord, ranks: Sequence[int]) -> str:
    """The one node all of ``ranks`` (those whose own loss was not finite) ran on, when
    the job has others; "" when they were on several, or none said, or the job has one."""
    nodes = {host_of(job, rank) for rank in ranks}
    if len(nodes) != 1 or len(set(job.nodes)) < 2:
        return ""
    return nodes.pop() or ""


def judge(job: JobRecord, fault: NumericFault) -> list[Action]:
    """What the newest fault (already on the record: :func:`seen`) means for the job."""
    limit = job.spec.policy.max_rewinds
    if limit == 0:
        said = f"numeric fault at step {fault.step} ({fault.reason})"
        return [FinishJob(JobState.FAILED, f"{said}; policy.max_rewinds = 0: no rewinds")]
    node = fault.node
    if node and len(mine := [f for f in job.numeric_faults if f.node == node]) > limit:
        job.numeric_faults = [f for f in job.numeric_faults if f.node != node]
        window = f"{REPEAT_WINDOW_S / 60:g} min"
        evidence = (
            f"the ranks of {node} alone computed non-finite values {len(mine)} times within "
            f"{window} (policy.max_rewinds = {limit}): {_listed(mine)}"
        )
        why = f"{evidence}; {node} held for a person, left out"
        failure = Failure(node=node, cause="numeric", step=fault.step)
        return [HoldNode(node, evidence), RestartJob(why, (node,), failure)]
    margin = same_place_steps(job.spec.checkpoint.every_steps)
    run = recurring(job.numeric_faults, margin)
    if len(run) <= limit:
        return []
    reason = (
        f"numeric fault at step {fault.step} ({fault.reason}) {len(run)} times in a row within "
        f"{margin} steps of each other or on the same data, rewound {len(run) - 1} times "
        f"(policy.max_rewinds = {limit}), not on one node alone: {_listed(run)}"
    )
    return [FinishJob(JobState.FAILED, reason)]


def _listed(faults: Sequence[NumericFault]) -> str:
    """Each fault in words: its step, where, when and why."""
    return "; ".join(
        f"step {f.step} ({f'{f.node} alone' if f.node else 'not one node'}, {at(f.at)}): {f.reason}"
        for f in faults
    )
