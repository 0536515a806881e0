"""Fault policy for what the ranks report of their progress: the preflight bandwidth,
stragglers, a stall with a node cut off, the ranks' exits (a numeric fault's rewind is
:mod:`coordinator.numeric_policy`'s). Pure functions from the job and a message to
actions, as :mod:`coordinator.policy` is for conditions and agents' events; the job
manager applies them."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from coordinator import network_culprit
from coordinator.actions import Action, FinishJob, RefuseNode, ReportStraggler, RestartJob
from coordinator.job_machine import LIVE
from coordinator.reconcile import host_of
from proto.conditions import Condition
from proto.job import Failure, JobRecord, JobState
from proto.progress import BandwidthChecked, Stragglers, slow_nodes


def on_bandwidth(job: JobRecord, msg: BandwidthChecked) -> list[Action]:
    """Rank 0's preflight bandwidth figures, before the first step: refuse every node of
    the job under ``min_bandwidth_ratio`` × the median of its peers and restart without
    them. The restart is not charged to the budget: nothing trained and nothing failed,
    and each refusal shrinks the nodes a job can be admitted to, so it cannot loop. The
    node is not drained: other jobs may not need its bandwidth."""
    if job.state is not JobState.STARTING:
        return []  # a late message from an earlier attempt, or the job moved on
    ratio = job.spec.policy.min_bandwidth_ratio
    slow = {
        node: median
        for node, median in slow_nodes(msg.node_gbps, ratio).items()
        if node in job.nodes
    }
    reasons = {
        node: f"{node} bus bandwidth {msg.node_gbps[node]:.1f} GB/s, under {ratio:g} × "
        f"the median {median:.1f} GB/s of its peers"
        for node, median in sorted(slow.items())
    }
    if not reasons:
        return []
    return [
        *(RefuseNode(node, why) for node, why in reasons.items()),
        RestartJob("; ".join(reasons.values()), tuple(reasons)),
    ]


def on_network_stall(
    job: JobRecord, links: Mapping[str, Sequence[Condition]], now: float
) -> list[Action]:
    """No step for the stall threshold with a node cut off from its peers: restart
    without it (:func:`coordinator.network_culprit.stalled_cut_off`)."""
    if (found := network_culprit.stalled_cut_off(job, links, now)) is None:
        return []
    stalled_s, cut = found
    said = "; ".join(f"{n}: {r}" for n, r in cut.items())
    why = f"no step for {stalled_s:.0f} s with a node cut off from its peers ({said}); left out"
    left_out = tuple(cut)
    return [RestartJob(why, left_out, Failure(node=left_out[0], cause="network", step=job.step))]


def on_stragglers(
    job: JobRecord, msg: Stragglers, reported: set[int], slow_before: set[int]
) -> list[Action]:
    """Ranks slower than ``straggler_ratio`` × their peers' median in two windows in a row
    (``slow_before``: the ranks :func:`slow_ranks` found in this attempt's previous window;
    ``reported``: ranks already reported this attempt). One slow window is a hiccup of the
    host (a checkpoint write, a neighbour's burst), not a slow GPU. With spares, the first
    straggler's node is replaced gracefully (uncharged: nothing failed)."""
    actions: list[Action] = []
    for rank, (seconds, median) in sorted(slow_ranks(job, msg).items()):
        node = host_of(job, rank)
        if rank in reported or rank not in slow_before or node is None:
            continue
        actions.append(ReportStraggler(node, rank, seconds, median))
        if job.spec.job.spares and not any(isinstance(a, RestartJob) for a in actions):
            why = f"rank {rank} on {node} straggles: {seconds:.3f} s/step vs {median:.3f} s"
            actions.append(RestartJob(why, (node,), graceful=True))
    return actions


def slow_ranks(job: JobRecord, msg: Stragglers) -> dict[int, tuple[float, float]]:
    """:func:`stragglers` of a window of the running attempt's world; none otherwise."""
    if job.state is not JobState.RUNNING or job.world_size != len(msg.rank_step_s):
        return {}
    return stragglers(msg.rank_step_s, job.spec.policy.straggler_ratio)


def stragglers(rank_step_s: list[float], ratio: float) -> dict[int, tuple[float, float]]:
    """Ranks whose time is over ``ratio`` × the median of the others', with that median."""
    slow = {}
    for rank, seconds in enumerate(rank_step_s):
        peers = [s for r, s in enumerate(rank_step_s) if r != rank and s > 0]
        if peers and seconds > ratio * (median := statistics.median(peers)):
            slow[rank] = (seconds, median)
    return slow


def all_exited(job: JobRecord) -> list[Action]:
    """Every rank of the current attempt has exited (cleanly, or on our stop). A job
    completes only when rank 0 of the current attempt said so and every rank exited 0;
    rank 0's last word may still be in flight (it travels on another stream), so a clean
    exit without it is left to :func:`overdue`. A job being restarted is not finishing:
    its ranks stopping is the restart's own doing."""
    if job.state not in LIVE or len(job.exited_ranks) < job.world_size:
        return []
    if job.stopping:
        return [FinishJob(JobState.STOPPED, job.reason or "stopped")]
    if any(code != 0 for code in job.exited_ranks.values()):
        return []  # a failed rank restarts the job (decide)
    if job.finished == "completed":
        return [FinishJob(JobState.COMPLETED, f"reached step {job.step}")]
    if job.spec.job.entry:
        # A user's own script reports no steps: a clean exit of every rank is success.
        return [FinishJob(JobState.COMPLETED, "every rank of the entry point exited 0")]
    return []


def overdue(job: JobRecord) -> list[Action]:
    """All ranks exited cleanly a while ago but rank 0's final word never came: complete
    when rank 0's own reports (the only ones taken) reached the target, else fail."""
    if job.state not in LIVE or len(job.exited_ranks) < job.world_size or not job.world_size:
        return []
    if any(code != 0 for code in job.exited_ranks.values()):
        return []
    if job.step >= job.target_steps:
        return [FinishJob(JobState.COMPLETED, f"reached step {job.step} (every rank exited 0)")]
    return [FinishJob(JobState.FAILED, f"ranks exited at step {job.step} of {job.target_steps}")]
