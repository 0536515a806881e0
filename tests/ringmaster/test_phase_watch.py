"""The phase watch's decision after a round (ringmaster.rank.phase_watch), without I/O:
every rank reads the same sum and so decides alike."""

from __future__ import annotations

import pytest

from ringmaster.rank.phase_watch import Mine, Next, Totals, decide, vector


def summed(*ranks: Mine) -> Totals:
    return Totals.of([sum(column) for column in zip(*map(vector, ranks), strict=True)])


QUIET = Mine(inside=True, asks=False, notice=False, held=False, step=8)
ASKING = Mine(inside=True, asks=True, notice=True, held=False, step=8, seq=3)
HELD = Mine(inside=True, asks=True, notice=False, held=True, step=8)
OUT = Mine(inside=False, asks=False, notice=False, held=False, step=8)

ROUNDS = {
    "nothing asked: the next round later": ((QUIET, QUIET), Next.WAIT),
    "one rank asks, all inside: hold": ((QUIET, ASKING), Next.HOLD),
    "every rank holds: save together": ((HELD, HELD), Next.SAVE),
    "one rank holds, one left its phase: the boundary decides": ((HELD, OUT), Next.END),
    "asked, but one rank left: the boundary decides": ((ASKING, OUT), Next.END),
    "inside at different steps: never saved": ((QUIET, Mine(True, True, True, True, 9)), Next.END),
    "one holds, one does not yet: hold again": ((HELD, ASKING), Next.HOLD),
}


@pytest.mark.parametrize("case", sorted(ROUNDS))
def test_a_round_decides_alike_from_the_sum(case: str) -> None:
    ranks, expected = ROUNDS[case]
    assert decide(summed(*ranks)) is expected


def test_the_sum_carries_the_notice_and_rank_0s_word() -> None:
    totals = summed(ASKING, HELD)
    assert (totals.ranks, totals.notice, totals.seq, totals.steps) == (2, 1, 3, 16)
