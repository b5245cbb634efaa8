"""Tests for pipetrain.partition.solve: exact min-max contiguous partitioning."""

from __future__ import annotations

import itertools
import random

import pytest

from pipetrain.partition import solve


def brute_force_min_max(costs: list[float], k: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def largest(costs: list[float], balance: list[int]) -> float:
    start, result = 0, 0.0
    for size in balance:
        result = max(result, sum(costs[start : start + size]))
        start += size
    return result


@pytest.mark.parametrize(
    ("costs", "k", "expected"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([1, 1, 1, 1, 1, 1], 3, [2, 2, 2]),
        ([1, 1, 8, 1, 1], 3, [2, 1, 2]),
        ([10, 1, 1, 1], 2, [1, 3]),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [5, 2, 2]),
        ([5, 5, 5], 1, [3]),
        ([4, 3, 2], 3, [1, 1, 1]),
        ([0, 0, 0, 0], 2, [2, 2]),  # no cost: even sizes
        ([1, 1, 1], 2, [1, 2]),  # ties go to the later partition
    ],
)
def test_known_cost_lists(costs, k, expected):
    assert solve(costs, k) == expected


def test_matches_brute_force_on_random_costs():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0, rng.randint(1, 20), rng.random() * 5]) for _ in range(n)]
        balance = solve(costs, k)
        assert len(balance) == k and sum(balance) == n and min(balance) >= 1
        assert largest(costs, balance) == pytest.approx(brute_force_min_max(costs, k))


def test_large_inputs_are_fast_enough():
    costs = [float((i * 7919) % 101) for i in range(400)]
    balance = solve(costs, 8)
    assert sum(balance) == 400
    assert largest(costs, balance) <= sum(costs) / 8 + max(costs)


@pytest.mark.parametrize(
    ("costs", "k", "expected"),
    [
        ([1, 2], 3, r"cannot cut 2 layers into 3 partitions .*use at most 2 partitions"),
        ([1, 2], 0, r"num_partitions must be at least 1, got 0"),
        ([1, 2], 1.5, r"num_partitions must be an integer, got 1.5"),
        ([1, -2, float("nan")], 2, r"costs\[1\] = -2, costs\[2\] = nan"),
    ],
)
def test_errors(costs, k, expected):
    with pytest.raises(ValueError, match=expected):
        solve(costs, k)
