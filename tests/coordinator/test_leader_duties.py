"""A leader's duty that fails is started again after the shared jittered backoff, whatever
it raised; stepping down (cancellation) ends it."""

from __future__ import annotations

import asyncio

import pytest

from coordinator import leader as leader_module
from coordinator.leader import Leadership

pytestmark = pytest.mark.anyio


async def test_a_failing_duty_is_restarted_until_it_runs_and_cancel_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(leader_module, "DUTY_RESTART_FIRST_S", 0.001)
    monkeypatch.setattr(leader_module, "DUTY_RESTART_CAP_S", 0.002)
    calls = 0
    running = asyncio.Event()

    async def duty() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("a bug in one message's handling")
        if calls == 2:
            raise OSError("the bus went away")
        running.set()
        await asyncio.Event().wait()  # runs until cancelled

    task = asyncio.create_task(Leadership._forever("jobs", duty))
    await asyncio.wait_for(running.wait(), 30)
    assert calls == 3 and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == 3  # a cancelled duty is not restarted
