"""The one retry policy of every daemon and the trainer: exponential backoff with full
jitter, capped, retrying only the exception types the caller names.

Why jitter: after a bus restart thousands of agents fail at the same instant; a fixed
backoff brings them back at the same instants too, every retry a thundering herd. With
full jitter (tenacity's ``wait_random_exponential``) the n-th wait is uniform between 0
and ``min(cap_s, first_s * 2**(n-1))``, so the herd spreads over the whole window.

Why named exceptions: a retry loop that catches everything retries bugs forever. Callers
say what a transient failure looks like (``OSError``, ``nats.errors.Error``, ...); anything
else goes straight through, and so does the last failure once the caller gives up (never
tenacity's ``RetryError``).

Use the result as a callable, ``retrying(...)(fn, *args)`` (``await`` it for the async
one), or as tenacity's ``for attempt in ...: with attempt:`` loop.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
    wait_random_exponential,
)
from tenacity.stop import stop_base

Errors = tuple[type[BaseException], ...]
# Told of each failure about to be retried, with the wait before the next try (to log it).
Note = Callable[[BaseException, float], None]


def backoff(first_s: float, cap_s: float) -> wait_random_exponential:
    """Full-jitter exponential waits: the first within [0, first_s], doubling to cap_s."""
    if not 0 < first_s <= cap_s:
        raise ValueError(f"backoff needs 0 < first_s <= cap_s, got {first_s} and {cap_s}")
    return wait_random_exponential(multiplier=first_s, max=cap_s)


def retrying(
    on: Errors,
    *,
    first_s: float,
    cap_s: float,
    attempts: int | None = None,
    give_up: Callable[[], bool] | None = None,
    note: Note | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Retrying:
    """Retries for blocking code (a plain thread). ``attempts``: tries in all (None: until
    it works or ``give_up()`` says stop); ``sleep``: how to wait, e.g. an Event's ``wait``
    so that closing cuts a wait short."""
    return Retrying(sleep=sleep, **_policy(on, first_s, cap_s, attempts, give_up, note))


def retrying_async(
    on: Errors,
    *,
    first_s: float,
    cap_s: float,
    attempts: int | None = None,
    give_up: Callable[[], bool] | None = None,
    note: Note | None = None,
    sleep: Callable[[float], Awaitable[Any]] | None = None,
) -> AsyncRetrying:
    """:func:`retrying` for coroutines; waits with ``asyncio.sleep`` unless told otherwise."""
    policy = _policy(on, first_s, cap_s, attempts, give_up, note)
    return AsyncRetrying(**policy) if sleep is None else AsyncRetrying(sleep=sleep, **policy)


class _GiveUp(stop_base):
    """Stop once the caller's predicate says so (a stop event set, a link closing)."""

    def __init__(self, give_up: Callable[[], bool]) -> None:
        self.give_up = give_up

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.give_up()


def _policy(
    on: Errors,
    first_s: float,
    cap_s: float,
    attempts: int | None,
    give_up: Callable[[], bool] | None,
    note: Note | None,
) -> dict[str, Any]:
    if not on or not all(isinstance(t, type) and issubclass(t, BaseException) for t in on):
        raise TypeError(f"retry needs exception types to retry, got {on!r}")
    if Exception in on or BaseException in on:
        raise ValueError("name the exceptions worth retrying, not every exception")
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    stop: stop_base = stop_never if attempts is None else stop_after_attempt(attempts)
    if give_up is not None:
        stop = stop | _GiveUp(give_up)

    def before_sleep(state: RetryCallState) -> None:
        if note is not None and state.outcome is not None and state.next_action is not None:
            error = state.outcome.exception()
            if error is not None:
                note(error, state.next_action.sleep)

    return {
        "retry": retry_if_exception_type(on),
        "wait": backoff(first_s, cap_s),
        "stop": stop,
        "before_sleep": before_sleep,
        "reraise": True,
    }
