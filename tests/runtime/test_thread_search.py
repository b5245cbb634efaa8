"""The thread count search: alternates a count and its half after a warm-up, takes the
half only when it is faster by the margin, goes on halving while that holds, and settles."""

from __future__ import annotations

import pytest

from pipetrain.runtime.thread_search import ThreadCountSearch


def _drive(search: ThreadCountSearch, cost: dict[int, float], calls: int) -> list[int]:
    """Run ``calls`` calls, each taking ``cost[count]`` seconds; the counts they ran at."""
    counts = []
    for _ in range(calls):
        count = search.next_count()
        counts.append(count)
        search.record(count, cost[count])
    return counts


def test_it_halves_while_the_half_is_faster_and_stops_at_the_first_that_is_not() -> None:
    search = ThreadCountSearch(start=8, warmup=1, trials=2)
    cost = {8: 1.0, 4: 0.8, 2: 0.7, 1: 0.9}
    counts = _drive(search, cost, 20)
    assert counts[:1] == [8]                   # the warm-up
    assert counts[1:5] == [4, 8, 4, 8]         # 4 against 8, alternating
    # 4 won and keeps its times: 2 against 4 until each has 2
    assert counts[5:8] == [2, 4, 2]
    assert counts[8:11] == [1, 2, 1]           # 2 won: 1 against 2, which stays
    assert search.settled and search.best == 2
    assert set(counts[11:]) == {2}


def test_a_half_within_the_margin_is_not_taken() -> None:
    search = ThreadCountSearch(start=2, warmup=0, trials=3, margin=0.05)
    _drive(search, {2: 1.0, 1: 0.97}, 6)
    assert search.settled and search.best == 2


def test_the_median_decides_so_one_slow_call_does_not() -> None:
    search = ThreadCountSearch(start=2, warmup=0, trials=3)
    times = {1: iter([0.5, 5.0, 0.5]), 2: iter([1.0, 1.0, 1.0])}
    for _ in range(6):
        count = search.next_count()
        search.record(count, next(times[count]))
    assert search.best == 1


def test_one_thread_or_a_fixed_count_has_nothing_to_search() -> None:
    assert ThreadCountSearch(start=1).settled
    fixed = ThreadCountSearch(start=8, fixed=3)
    assert fixed.settled and _drive(fixed, {3: 1.0}, 3) == [3, 3, 3]


def test_a_call_from_before_a_change_is_not_counted() -> None:
    search = ThreadCountSearch(start=4, warmup=0, trials=1)
    _drive(search, {4: 1.0, 2: 0.5}, 2)       # 2 wins: 1 against 2 next
    search.record(4, 0.01)                      # a late call at 4 changes nothing
    _drive(search, {2: 0.5, 1: 0.9}, 2)
    assert search.settled and search.best == 2


@pytest.mark.parametrize("bad", [0, -2])
def test_a_count_below_one_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match=f"at least 1, got {bad}"):
        ThreadCountSearch(start=bad)
