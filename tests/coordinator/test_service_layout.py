"""The coordinator's start-up wait for JetStream: bus failures are retried until the
layout exists or the coordinator is asked to stop; anything else is a bug and surfaces."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from nats.js import JetStreamContext
from nats.js.errors import ServiceUnavailableError

from coordinator import service
from coordinator.service import Coordinator

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
