"""The shared retry policy: full-jitter waits inside a doubling window up to the cap, only
the named exceptions retried, the last failure passed through on giving up."""

from __future__ import annotations

import statistics

import pytest

from ringmaster.retry import retrying, retrying_async

FIRST, CAP, TRIES = 0.1, 2.0, 10


class Flaky:
    """Raises ``errors`` in turn, then returns how many calls it took."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors, self.calls = list(errors), 0

    def __call__(self) -> int:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.calls


def waits_of_one_client() -> list[float]:
    waits: list[float] = []
    always = Flaky(*(OSError(i) for i in range(TRIES)))
    with pytest.raises(OSError):
        retrying((OSError,), first_s=FIRST, cap_s=CAP, attempts=TRIES, sleep=waits.append)(always)
    assert len(waits) == TRIES - 1 and always.calls == TRIES
    return waits


def test_waits_are_jittered_within_a_doubling_window_and_the_cap_holds() -> None:
    clients = [waits_of_one_client() for _ in range(300)]
    for n, waits in enumerate(zip(*clients, strict=True)):
        window = min(CAP, FIRST * 2**n)
        assert all(0 <= w <= window for w in waits), (n, max(waits))
        # spread over the whole window, not bunched at its end: no lockstep
        assert min(waits) < 0.1 * window and max(waits) > 0.9 * window, (n, waits)
        assert 0.35 * window < statistics.fmean(waits) < 0.65 * window
    first = [waits[0] for waits in clients]
    assert len(set(first)) == len(first)  # 300 clients failing together retry apart
    assert max(max(waits) for waits in clients) <= CAP


def test_only_the_named_exceptions_are_retried() -> None:
    flaky = Flaky(ConnectionRefusedError(), TimeoutError())  # both are OSError
    assert retrying((OSError,), first_s=FIRST, cap_s=CAP, sleep=lambda s: None)(flaky) == 3
    bug = Flaky(ValueError("a bug"), ValueError("again"))
    with pytest.raises(ValueError, match="a bug"):
        retrying((OSError,), first_s=FIRST, cap_s=CAP, sleep=lambda s: None)(bug)
    assert bug.calls == 1


def test_giving_up_passes_the_last_failure_through() -> None:
    always = Flaky(*(OSError(f"try {i}") for i in range(1, 9)))
    with pytest.raises(OSError, match="try 3"):
        retrying((OSError,), first_s=FIRST, cap_s=CAP, attempts=3, sleep=lambda s: None)(always)
    closing = Flaky(*(OSError(f"try {i}") for i in range(1, 9)))
    told: list[tuple[str, float]] = []
    with pytest.raises(OSError, match="try 2"):
        retrying(
            (OSError,),
            first_s=FIRST,
            cap_s=CAP,
            give_up=lambda: closing.calls >= 2,
            note=lambda exc, wait: told.append((str(exc), wait)),
            sleep=lambda s: None,
        )(closing)
    assert [text for text, _ in told] == ["try 1"] and 0 <= told[0][1] <= FIRST


@pytest.mark.anyio
async def test_the_async_form_follows_the_same_policy() -> None:
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    flaky = Flaky(OSError(), OSError(), OSError())

    async def call() -> int:
        return flaky()

    policy = retrying_async((OSError,), first_s=FIRST, cap_s=CAP, sleep=record)
    assert await policy(call) == 4
    assert len(waits) == 3 and all(0 <= w <= min(CAP, FIRST * 2**n) for n, w in enumerate(waits))
    bug = Flaky(KeyError("k"))

    async def broken() -> int:
        return bug()

    with pytest.raises(KeyError):
        await retrying_async((OSError,), first_s=FIRST, cap_s=CAP, sleep=record)(broken)
    assert bug.calls == 1


@pytest.mark.parametrize("on", [(), (Exception,), (OSError, BaseException), ("OSError",)])
def test_what_is_retried_must_be_named(on: tuple[type[BaseException], ...]) -> None:
    with pytest.raises((TypeError, ValueError)):
        retrying(on, first_s=FIRST, cap_s=CAP)


def test_a_backoff_needs_a_positive_first_wait_under_its_cap() -> None:
    with pytest.raises(ValueError, match="first_s"):
        retrying((OSError,), first_s=3.0, cap_s=2.0)
