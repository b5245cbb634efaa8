"""Tests of pipetrain.models.factory: seeding, building, tying, counting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.models.factory import (
    build_sequential,
    count_parameters,
    derive_seed,
    seeded,
    tie_parameters,
)


def test_derive_seed_is_stable_and_distinguishes_parts() -> None:
    assert derive_seed(0, 10) == derive_seed(0, 10)
    assert derive_seed(0, 10) != derive_seed(1, 0)
    assert derive_seed(0, 10) != derive_seed(0, "10")  # type is part of the key
    assert 0 <= derive_seed(123, 456) < 2**63


def test_seeded_is_reproducible_and_leaves_caller_rng_alone() -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = seeded(lambda: nn.Linear(8, 8), seed=1, index=3)
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(100)  # consume the caller's RNG: must not matter
    b = seeded(lambda: nn.Linear(8, 8), seed=1, index=3)
    c = seeded(lambda: nn.Linear(8, 8), seed=1, index=4)
    assert torch.equal(a.weight, b.weight)
    assert not torch.equal(a.weight, c.weight)


def test_tie_parameters_shares_one_parameter() -> None:
    model = build_sequential(
        [lambda: nn.Linear(3, 3), lambda: nn.Sequential(nn.Linear(3, 3))],
        ties=[((0, "weight"), (1, "0.weight"))],
    )
    assert model[0].weight is model[1][0].weight
    assert count_parameters(model) == 9 + 3 + 3  # the shared weight counted once


def test_tie_parameters_errors_name_the_problem() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"shape \(4, 3\).*same shape"):
        tie_parameters(model, [((0, "weight"), (1, "weight"))])
    with pytest.raises(ValueError, match="layer 5 but the model has 2 layers"):
        tie_parameters(model, [((0, "weight"), (5, "weight"))])
    with pytest.raises(ValueError, match="'nope' of layer 1"):
        tie_parameters(model, [((0, "weight"), (1, "nope"))])


def test_count_parameters_trainable_only() -> None:
    model = nn.Linear(4, 2)
    model.bias.requires_grad_(False)
    assert count_parameters(model) == 10
    assert count_parameters(model, trainable_only=True) == 8


def test_seeded_is_deterministic_across_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    def build(index: int) -> torch.Tensor:
        return seeded(lambda: nn.Linear(64, 64), seed=0, index=index).weight.detach()

    expected = [build(index) for index in range(16)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            results = list(pool.map(build, range(16)))
            assert all(torch.equal(a, b) for a, b in zip(expected, results))
