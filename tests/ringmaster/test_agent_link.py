"""The rank-0 ↔ agent channel against the fake agent: order, control words, and an agent
that goes away and comes back while training goes on."""

from __future__ import annotations

from pathlib import Path

from proto.progress import Finished, StepDone
from ringmaster.rank.agent_link import AgentLink
from ringmaster.rank.fake_agent import FakeAgent


def test_progress_and_control_words_flow(tmp_path: Path) -> None:
    agent = FakeAgent(tmp_path / "agent.sock")
    link = AgentLink(agent.path, "job-1").start()
    try:
        for step in range(1, 4):
            link.send(StepDone(step=step, loss=1.0 / step, target_steps=3))
        last = agent.wait_for(StepDone, lambda m: m.step == 3, timeout=10)
        assert [m.step for m in agent.messages] == [1, 2, 3]
        assert last.job == "job-1" and last.time > 0
        agent.send("pause")
        agent.send("checkpoint")
        words = [link.controls.get(timeout=10), link.controls.get(timeout=10)]
        assert [(w.action, w.seq) for w in words] == [("pause", 1), ("checkpoint", 2)]
        assert link.drain() == []
    finally:
        link.close()
        agent.close()


def test_survives_agent_restart_and_delivers_what_was_queued(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    agent = FakeAgent(path)
    link = AgentLink(path, "job-1").start()
    try:
        link.send(StepDone(step=1))
        agent.wait_for(StepDone, lambda m: m.step == 1, timeout=10)
        agent.close()  # the agent goes away; the trainer keeps reporting
        for step in (2, 3):
            link.send(StepDone(step=step))
        agent = FakeAgent(path)  # ... and comes back on the same path
        agent.wait_for(StepDone, lambda m: m.step == 3, timeout=10)
        assert link.connections == 2
        assert [m.step for m in agent.messages][-2:] == [2, 3]
        agent.send("resume")
        assert link.controls.get(timeout=10).action == "resume"
        link.send(Finished(step=3))
        link.close()
        finished = agent.wait_for(Finished, timeout=10)
        assert finished.step == 3
    finally:
        link.close()
        agent.close()


def test_no_agent_never_blocks_or_raises(tmp_path: Path) -> None:
    link = AgentLink(tmp_path / "nobody.sock", "job-1").start()
    for step in range(5000):  # more than the outbox holds: the oldest are dropped
        link.send(StepDone(step=step))
    link.close(flush_timeout_s=30)  # closing cuts the reconnect backoff short
    assert link.connections == 0
    assert not link._thread.is_alive()  # gave up retrying: nobody to flush to
