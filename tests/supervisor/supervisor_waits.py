"""Waiting on a condition in the supervisor tests: polled, bounded, never a sleep."""

from __future__ import annotations

from collections.abc import Callable

from ringmaster.procs import wait_until_async


async def until(pred: Callable[[], object], timeout: float = 20.0) -> None:
    """Until ``pred()`` holds; an AssertionError after ``timeout`` seconds."""

    async def holds() -> bool:
        return bool(pred())

    try:
        await wait_until_async(holds, timeout, interval=0.02)
    except TimeoutError:
        raise AssertionError("condition not met in time") from None
