"""Waiting in a test for something real (a process, a thread, a socket, a file): polled and
bounded through ``ringmaster.procs``, never slept for. A wait that runs out fails with what
was awaited and what was seen last (``seen``), not with a bare ``TimeoutError``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ringmaster.procs import wait_until, wait_until_async

T = TypeVar("T")


def _failed(awaited: str, timeout: float, seen: Callable[[], object] | None) -> AssertionError:
    last = "" if seen is None else f"; last seen: {seen()}"
    return AssertionError(f"{awaited}: not within {timeout:g} s{last}")


def until(
    predicate: Callable[[], T | None],
    timeout: float,
    awaited: str,
    seen: Callable[[], object] | None = None,
    interval: float = 0.02,
) -> T:
    """``predicate``'s first truthy result; an AssertionError after ``timeout`` seconds."""
    try:
        return wait_until(predicate, timeout, interval)
    except TimeoutError:
        raise _failed(awaited, timeout, seen) from None


async def until_async(
    predicate: Callable[[], T | None],
    timeout: float,
    awaited: str,
    seen: Callable[[], object] | None = None,
    interval: float = 0.02,
) -> T:
    """:func:`until` in a coroutine: the loop runs on between the tries."""

    async def holds() -> T | None:
        return predicate()

    try:
        return await wait_until_async(holds, timeout, interval)
    except TimeoutError:
        raise _failed(awaited, timeout, seen) from None
