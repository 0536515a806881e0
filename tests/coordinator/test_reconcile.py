"""Reconciliation, exclusions and the stalled-time ledger, pure and without NATS."""

from __future__ import annotations

import asyncio

import pytest
from test_jobs import Cluster, spec

from coordinator import exclusion
from coordinator.goodput import account
from coordinator.reconcile import (
    Exited,
    Memo,
    Missing,
    hosts_rank,
    job_findings,
    knows_launch,
    orphans,
)
from coordinator.registry import NodeInfo, Registry
from proto.api import JobControl, SubmitJob
from proto.commands import Stop
from proto.job import JobRecord, JobState
from proto.node import Heartbeat, RankReport


def record(state: JobState = JobState.RUNNING, **kw: object) -> JobRecord:
    base: dict[str, object] = dict(
        id="j-1", name="j", spec=spec(2), state=state, attempt=2, world_size=2,
        nodes=["node-0", "node-1"],
    )  # fmt: skip
    base.update(kw)
    return JobRecord(**base)  # type: ignore[arg-type]


def node(name: str, *reports: RankReport) -> NodeInfo:
    return NodeInfo(id=name, ranks=list(reports), agent_started_at=1.0)


def rank(r: int, attempt: int = 2, alive: bool = True, **kw: object) -> RankReport:
    return RankReport(job="j-1", rank=r, attempt=attempt, pid=100 + r, alive=alive, **kw)  # type: ignore[arg-type]


def test_only_the_host_of_a_rank_in_the_current_attempt_speaks_for_it() -> None:
    job = record()
    assert hosts_rank(job, "node-1", 1, 2)
    assert not hosts_rank(job, "node-0", 1, 2)  # another node
    assert not hosts_rank(job, "node-1", 1, 1)  # an earlier attempt
    assert not hosts_rank(job, "node-1", 1, 0)  # unknown attempt
    assert not hosts_rank(job, "node-2", 2, 2)  # no such rank


def test_exits_and_missing_ranks_are_found_on_settled_nodes_only() -> None:
    job = record()
    nodes = {
        "node-0": node("node-0", rank(0)),
        "node-1": node("node-1", rank(1, alive=False, exit_code=1)),
    }
    found = job_findings(job, nodes, lambda n: True)
    assert found == [Exited("node-1", nodes["node-1"].ranks[0])]
    nodes["node-1"] = node("node-1", rank(1, attempt=1))  # still the old attempt's rank
    assert job_findings(job, nodes, lambda n: True) == [Missing("node-1", 1)]
    assert job_findings(job, nodes, lambda n: n.id == "node-0") == []  # not settled yet
    job.exited_ranks = {"1": 1}  # already known: not found twice
    assert job_findings(job, nodes, lambda n: True) == []
    job.exited_ranks, job.stopping_attempt = {}, 2  # being stopped: nothing to find
    assert job_findings(job, nodes, lambda n: True) == []


def test_only_a_beat_built_after_the_launch_speaks_for_its_attempt() -> None:
    """A beat names the attempts whose launch its agent had carried out: it speaks for
    attempt 2 once it names 2 (or a later one), never while it names an older one or none,
    whatever its stamp. A beat of a later agent process than the one that answered the
    launch speaks too (every beat of it is newer); an agent that names nothing at all
    leaves the caller to its clocks."""
    beat = NodeInfo(id="node-1", agent_started_at=10.0)
    assert knows_launch(beat, "j-1", 2, answered_by=10.0) is None  # an older agent
    beat.launched = {"j-1": 1, "j-2": 5}
    assert knows_launch(beat, "j-1", 2, answered_by=10.0) is False  # built before it
    assert knows_launch(beat, "j-1", 1, answered_by=10.0) is True
    assert knows_launch(beat, "j-2", 2, answered_by=10.0) is True  # a later one launched
    beat.launched = {}
    assert knows_launch(beat, "j-1", 2, answered_by=10.0) is False
    assert knows_launch(beat, "j-1", 2, answered_by=0.0) is False  # who answered: unknown
    assert knows_launch(beat, "j-1", 2, answered_by=9.0) is True  # a restarted agent's
    beat.agent_started_at = 8.0
    assert knows_launch(beat, "j-1", 2, answered_by=9.0) is False  # an earlier process's


def test_orphans_are_live_ranks_nothing_expects() -> None:
    job = record()
    nodes = {
        "node-0": node("node-0", rank(0), rank(1, attempt=1)),  # an old attempt's rank
        "node-2": node("node-2", rank(1)),  # the current attempt's rank 1, on another node
        "node-1": node("node-1", rank(1), rank(0, attempt=3)),  # newer than the record
    }
    found = {
        (o.node, o.report.rank, o.report.attempt)
        for o in orphans({"j-1": job}, nodes, lambda n: True)
    }
    assert found == {("node-0", 1, 1), ("node-2", 1, 2)}
    job.stopping_attempt = 1  # that old attempt's stop is under way: leave it to the stop
    found = {(o.node, o.report.attempt) for o in orphans({"j-1": job}, nodes, lambda n: True)}
    assert found == {("node-2", 2)}
    job.state = JobState.STOPPED  # an ended job: every live rank is an orphan
    assert len(orphans({"j-1": job}, nodes, lambda n: n.id != "node-1")) == 3
    assert len(orphans({}, nodes, lambda n: True)) == 5  # a job nobody knows


def test_ranks_are_judged_by_the_node_that_hosts_them_with_several_gpus_a_node() -> None:
    """Three nodes of 4 ranks (node-1 hosts ranks 4 to 7): each rank is looked for on its
    own node only, and a rank reported elsewhere is an orphan there."""
    s = spec(3)
    s.job.gpus_per_node = 4
    job = record(spec=s, world_size=12, nodes=["node-0", "node-1", "node-2"])
    nodes = {
        "node-0": node("node-0", *(rank(r) for r in range(4))),
        "node-1": node("node-1", rank(4), rank(5), rank(6, alive=False, exit_code=1)),
        "node-2": node("node-2", *(rank(r) for r in range(8, 12)), rank(3)),
    }
    assert job_findings(job, nodes, lambda n: True) == [
        Exited("node-1", nodes["node-1"].ranks[2]),
        Missing("node-1", 7),
    ]
    assert hosts_rank(job, "node-1", 7, 2) and not hosts_rank(job, "node-2", 3, 2)
    assert not hosts_rank(job, "node-2", 12, 2)  # past the world
    [orphan] = orphans({"j-1": job}, nodes, lambda n: True)
    assert (orphan.node, orphan.report.rank) == ("node-2", 3)


def test_with_a_memo_a_pass_looks_only_at_nodes_whose_reports_changed() -> None:
    """Beats that change only the ranks' steps leave a node's findings as they were, and
    the memo does not look at it again; a beat that changes what a rank is (it exited)
    is looked at, and the findings are those of a pass without the memo."""
    job = record()
    reg = Registry()
    memo, orphan_memo = Memo(), Memo()

    def beat(name: str, seq: int, *reports: RankReport) -> None:
        reg.observe(Heartbeat(node=name, seq=seq, sent_at=float(seq), ranks=reports), seq)

    def same_as_without() -> list[Exited | Missing]:
        found = job_findings(job, reg.nodes, lambda n: True, memo)
        assert found == job_findings(job, reg.nodes, lambda n: True)
        stray = orphans({"j-1": job}, reg.nodes, lambda n: True, orphan_memo)
        assert stray == orphans({"j-1": job}, reg.nodes, lambda n: True)
        return found

    for seq in (1, 2, 3):  # training: the steps move on, nothing else does
        beat("node-0", seq, rank(0, last_step=seq))
        beat("node-1", seq, rank(1, last_step=seq), rank(0, attempt=1))
        assert same_as_without() == []
    assert orphans({"j-1": job}, reg.nodes, lambda n: True)  # the old attempt's rank 0
    assert reg.ranked == {"node-0", "node-1"}  # the nodes a pass looks at for orphans
    version = reg.nodes["node-0"].ranks_version
    beat("node-0", 4, rank(0, last_step=4))
    assert reg.nodes["node-0"].ranks_version == version
    # not looked at again: a report changed behind the registry's back goes unseen ...
    reg.nodes["node-0"].ranks = (rank(0, alive=False, exit_code=1),)
    assert job_findings(job, reg.nodes, lambda n: True, memo) == []
    # ... until a beat says it, or the memo is cleared for a full pass
    beat("node-0", 5, rank(0, alive=False, exit_code=1))
    assert reg.nodes["node-0"].ranks_version == version + 1
    assert same_as_without() == [Exited("node-0", reg.nodes["node-0"].ranks[0])]
    job.exited_ranks = {"0": 1}  # the exit recorded: found no more
    assert same_as_without() == []
    job.state = JobState.STOPPED  # the job ended: its ranks anywhere are orphans
    assert len(orphans({"j-1": job}, reg.nodes, lambda n: True, orphan_memo)) == 2
    beat("node-1", 6)  # its ranks gone
    assert reg.ranked == {"node-0"}


def test_a_left_out_node_comes_back_after_its_time_or_a_healthy_restart() -> None:
    job = record()
    job.spec.policy.exclude_s = 100.0
    nodes = {"node-1": node("node-1")}
    exclusion.leave_out(job, "node-1", "node node-1 lost", 1000.0, nodes["node-1"])
    assert "node node-1 lost" in exclusion.left_out(job, nodes, 1050.0)["node-1"]
    assert exclusion.left_out(job, nodes, 1101.0) == {}  # its time is up
    nodes["node-1"].agent_started_at = 2.0  # a new agent start, healthy: back at once
    assert exclusion.left_out(job, nodes, 1050.0) == {}
    nodes["node-1"].conditions = {}
    nodes["node-1"].state = nodes["node-1"].state.DEGRADED
    assert "node-1" in exclusion.left_out(job, nodes, 1050.0)  # restarted, but not healthy


def test_a_left_out_node_comes_back_once_its_life_returns_it() -> None:
    """Drained for the fault (a preemption notice, its loss) and returned by its own life
    after a probation: back in the job at once, not when exclude_s runs out."""
    job = record()
    nodes = {"node-1": node("node-1")}
    exclusion.leave_out(job, "node-1", "preemption notice", 1000.0, nodes["node-1"])
    nodes["node-1"].serving_since = 900.0  # returned before it was left out: no evidence
    assert "node-1" in exclusion.left_out(job, nodes, 1050.0)
    nodes["node-1"].serving_since = None  # drained, then on probation
    assert "node-1" in exclusion.left_out(job, nodes, 1050.0)
    nodes["node-1"].serving_since = 1120.0  # its probation passed: back
    assert exclusion.left_out(job, nodes, 1121.0) == {}


def test_a_node_that_faults_again_soon_is_left_out_longer_each_time() -> None:
    job = record()
    job.spec.policy.exclude_s = 100.0
    exclusion.leave_out(job, "node-1", "x", 0.0, None)
    assert job.excluded["node-1"].until == 100.0
    exclusion.leave_out(job, "node-1", "x", 150.0, None)  # soon after
    assert job.excluded["node-1"].count == 2 and job.excluded["node-1"].until == 350.0
    exclusion.leave_out(job, "node-1", "x", 10_000.0, None)  # long after
    assert job.excluded["node-1"].count == 1


def test_a_node_its_life_returned_starts_its_backoff_afresh() -> None:
    """Left out for a preemption notice that passed, drained and returned by its life:
    a straggler soon after is left out for exclude_s, not twice that."""
    job = record()
    job.spec.policy.exclude_s = 100.0
    info = node("node-1")
    exclusion.leave_out(job, "node-1", "preemption notice", 0.0, info)
    info.serving_since = 90.0  # its probation served
    exclusion.leave_out(job, "node-1", "straggles", 150.0, info)
    assert job.excluded["node-1"].count == 1 and job.excluded["node-1"].until == 250.0
    exclusion.leave_out(job, "node-1", "straggles again", 260.0, info)  # not returned since
    assert job.excluded["node-1"].count == 2


def test_time_without_a_step_past_the_hang_threshold_is_recovery() -> None:
    job = record(world_size=2)
    job.step_s, job.last_step_at = 0.1, 100.0  # threshold: max(3 × 0.1, 3 s floor) = 3 s
    account(job, 100.0)
    account(job, 110.0)
    assert job.goodput["productive"] == 2 * 3.0  # up to the threshold
    assert job.goodput["recovery"] == 2 * 7.0  # the rest: nothing trained


@pytest.mark.anyio
async def test_an_orphan_reported_for_over_a_beat_is_killed_bounded_to_its_attempt() -> None:
    c = Cluster()
    m = c.leader()
    job = m.jobs[(await m.submit(SubmitJob(spec=spec(2), workdir="/w"))).job]
    await m.start_pending(job)
    await m.control(JobControl(job=job.id, action="stop"))
    await m.settle()
    assert job.state is JobState.STOPPED
    kills = len(c.agents.commands(Stop))
    report = RankReport(job=job.id, rank=1, attempt=job.attempt, pid=7, alive=True)

    async def tick_after(seconds: float) -> None:
        """A tick ``seconds`` on, after node-1's beat that still lists the rank."""
        c.clock.advance(seconds)
        beat = Heartbeat(node="node-1", seq=9, sent_at=c.clock.time(), gpus=1, ranks=[report])
        c.registry.observe(beat, c.clock.monotonic())
        await m.tick()
        await m.settle()

    await tick_after(1.0)
    assert len(c.agents.commands(Stop)) == kills  # one beat may show a rank just stopped
    await tick_after(1.0)
    await tick_after(1.0)  # listed for over a beat and a half
    [kill] = c.agents.commands(Stop)[kills:]
    assert isinstance(kill, Stop) and kill.force and kill.attempt == job.attempt
    await tick_after(1.0)  # still reported: not again before ORPHAN_RETRY_S
    assert len(c.agents.commands(Stop)) == kills + 1


@pytest.mark.anyio
async def test_a_node_still_starting_its_ranks_is_not_missing_them() -> None:
    """Until every node has answered the launch, a beat without the new ranks is no
    evidence: node-1 may be waiting for its ranks' interpreters."""
    c = Cluster()
    m = c.leader()
    job = m.jobs[(await m.submit(SubmitJob(spec=spec(2), workdir="/w"))).job]
    c.agents.slow.add("node-1")
    await m.tick()  # starts the launch; node-0 answers, node-1 does not yet
    for _ in range(20):
        await asyncio.sleep(0)
    assert job.state is JobState.STARTING and job.attempt == 1
    for seq in (5, 6):  # beats from both nodes well after the launch began
        c.clock.advance(10.0)
        started = RankReport(job=job.id, rank=0, attempt=1, pid=10_000, alive=True)
        for name, ranks in (("node-0", [started]), ("node-1", [])):
            beat = Heartbeat(node=name, seq=seq, sent_at=c.clock.time(), gpus=1, ranks=ranks)
            c.registry.observe(beat, c.clock.monotonic())
        await m.tick()
    assert job.state is JobState.STARTING and job.restarts == 0, job.reason
    assert "exited" not in " ".join(c.kinds())
    c.agents.go.set()
    await m.settle()
    assert job.state is JobState.STARTING and job.restarts == 0
    assert m.launcher.launched_at[job.id][0] == 1


@pytest.mark.anyio
async def test_a_beat_sent_before_the_launch_answer_is_no_evidence_however_late_it_comes() -> None:
    """A starved coordinator takes node-1's beats seconds late (or a bus outage's end
    moves its last-seen time): a beat node-1 sent before it answered the launch does not
    list the new rank, however long after the launch it is read. Only a beat node-1 sent
    after its answer can say the rank is missing."""
    c = Cluster()
    m = c.leader()
    job = m.jobs[(await m.submit(SubmitJob(spec=spec(2), workdir="/w"))).job]
    await m.tick()
    await m.settle()
    assert job.state is JobState.STARTING and job.attempt == 1
    answered = m.launcher.answered_at[job.id]["node-1"]
    ours = RankReport(job=job.id, rank=0, attempt=1, pid=10_000, alive=True)
    c.registry.bus_alive(c.clock.monotonic())  # the coordinator's canary, before an outage
    c.clock.advance(30.0)  # read long after the launch
    for name, ranks, sent in (("node-0", [ours], answered + 1), ("node-1", [], answered - 0.5)):
        beat = Heartbeat(node=name, seq=9, sent_at=sent, gpus=1, ranks=ranks)
        c.registry.observe(beat, c.clock.monotonic())
    c.clock.advance(5.0)
    c.registry.bus_alive(c.clock.monotonic())  # an outage's end moves every node's last-seen time
    await m.tick()
    await m.settle()
    assert job.restarts == 0 and "worker.exited" not in c.kinds(), job.reason
    c.clock.advance(1.0)
    beat = Heartbeat(node="node-1", seq=10, sent_at=answered + 0.5, gpus=1, ranks=[])
    c.registry.observe(beat, c.clock.monotonic())  # sent after its answer: the rank is missing
    await m.tick()
    await m.settle()
    assert "worker.exited" in c.kinds() and job.restarts == 1, job.reason


@pytest.mark.anyio
async def test_a_beat_built_before_the_launch_is_no_evidence_whatever_its_stamp() -> None:
    """node-1's agent built a beat before it launched attempt 1's rank, then its clock was
    stepped back (a resync) before it answered: the old beat's stamp is later than the
    answer's, and it is read long after the launch. It names no launch of attempt 1, so it
    proves nothing. The next beat does name it: a rank it then does not list is missing."""
    c = Cluster()
    m = c.leader()
    job = m.jobs[(await m.submit(SubmitJob(spec=spec(2), workdir="/w"))).job]
    early = c.agents.heartbeat("node-1", seq=9, sent_at=0.0, addr="10.0.0.2")
    await m.tick()
    await m.settle()
    assert job.state is JobState.STARTING and job.attempt == 1
    answered, launched = m.launcher.answered_at[job.id]["node-1"], m.launcher.launched_at[job.id]
    early.sent_at = answered + 5.0  # stamped before the clock went back: it fools the clocks
    late = launched[1] + 30.0
    c.registry.observe(c.agents.heartbeat("node-0", 9, answered + 1.0, "10.0.0.1"), late)
    c.registry.observe(early, late)
    c.registry.bus_alive(late + 5.0)
    await m.tick()
    await m.settle()
    assert job.restarts == 0 and "worker.exited" not in c.kinds(), job.reason
    beat = c.agents.heartbeat("node-1", seq=10, sent_at=early.sent_at, addr="10.0.0.2")
    beat.ranks = ()  # built after the launch, and the rank is gone
    c.registry.observe(beat, late + 6.0)
    await m.tick()
    await m.settle()
    assert "worker.exited" in c.kinds() and job.restarts == 1, job.reason


@pytest.mark.anyio
async def test_a_restarted_agent_that_found_no_rank_alive_speaks_for_the_attempt() -> None:
    """node-1's agent restarted after answering the launch and found the job's rank dead,
    so it adopted nothing and names no launch of the job: its beats are newer than the
    answer all the same (a later process), and the rank is missing."""
    c = Cluster()
    m = c.leader()
    job = m.jobs[(await m.submit(SubmitJob(spec=spec(2), workdir="/w"))).job]
    await m.tick()
    await m.settle()
    answered, (_, now) = m.launcher.answered_at[job.id]["node-1"], m.launcher.launched_at[job.id]
    c.registry.observe(c.agents.heartbeat("node-0", 9, answered + 1.0, "10.0.0.1"), now)
    beat = Heartbeat(node="node-1", seq=1, sent_at=answered + 1.0, gpus=1, launched={})
    beat.started_at = c.agents.started_at  # the agent that answered, before it launched
    c.registry.observe(beat, now)
    await m.tick()
    await m.settle()
    assert job.restarts == 0 and "worker.exited" not in c.kinds(), job.reason
    beat.started_at = c.agents.started_at + 60.0  # a new agent process
    c.registry.observe(beat, now)
    await m.tick()
    await m.settle()
    assert "worker.exited" in c.kinds() and job.restarts == 1, job.reason
