"""The coordinator's start-up wait for JetStream: bus failures are retried until the
layout exists or the coordinator is asked to stop; anything else is a bug and surfaces.
A take-over that cannot read the jobs yet is tried again, never the coordinator's end."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from nats.js import JetStreamContext
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from coordinator import service
from coordinator.embedded_nats import NatsServer
from coordinator.jobs import JobManager
from coordinator.service import Coordinator
from ringmaster.procs import wait_until_async

pytestmark = pytest.mark.anyio
JS = cast(JetStreamContext, object())


def layout_failing(monkeypatch: pytest.MonkeyPatch, *failures: BaseException) -> list[int]:
    calls: list[int] = []

    async def ensure_layout(js: JetStreamContext, cluster: str, replicas: int) -> Any:
        calls.append(replicas)
        if failures[len(calls) - 1 :]:
            raise failures[len(calls) - 1]
        return "buckets"

    monkeypatch.setattr(service, "ensure_layout", ensure_layout)
    return calls


async def test_jetstream_not_ready_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = layout_failing(monkeypatch, ServiceUnavailableError(), TimeoutError())
    got = await Coordinator("nats://x", "c", "me")._layout(JS, asyncio.Event())
    assert got == "buckets" and len(calls) == 3


async def test_a_bug_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = layout_failing(monkeypatch, KeyError("bug"), KeyError("bug"))
    with pytest.raises(KeyError):
        await Coordinator("nats://x", "c", "me")._layout(JS, asyncio.Event())
    assert len(calls) == 1


async def test_asked_to_stop_it_gives_up_with_the_bus_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stop = asyncio.Event()
    stop.set()
    calls = layout_failing(monkeypatch, *[ServiceUnavailableError()] * 5)
    with pytest.raises(ServiceUnavailableError):
        await Coordinator("nats://x", "c", "me")._layout(JS, stop)
    assert len(calls) == 1


async def test_a_take_over_that_cannot_read_the_jobs_is_tried_again(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server of a cluster dies: the jobs bucket has no stream leader for a few seconds,
    and a coordinator winning the lease then fails to load the jobs. It must keep the lease
    and try again, not end (a job would then sit in its last state with nobody leading)."""
    loads: list[None] = []
    real_load = JobManager.load

    async def load(self: JobManager) -> None:
        loads.append(None)
        if len(loads) <= 2:
            raise NoStreamResponseError
        await real_load(self)

    monkeypatch.setattr(JobManager, "load", load)
    coordinator = Coordinator(nats_server.url, "c", "me", ttl=2.0)
    stop = asyncio.Event()
    running = asyncio.create_task(coordinator.run(stop))

    async def leading() -> bool:
        assert not running.done(), "the coordinator ended"
        return coordinator._leadership is not None

    try:
        await wait_until_async(leading, timeout=30)
        assert len(loads) == 3
    finally:
        stop.set()
        await asyncio.wait_for(running, timeout=15)
