"""PipeDream's cost model (``pipetrain/plan/costs_pipedream.py``) and the generic helpers."""

from __future__ import annotations

import random

import pytest

from pipetrain.plan.costs import (
    LevelContext,
    StageLoad,
    StageRow,
    scan_memory_replicas,
    scan_min_replicas,
)

from .helpers import MODEL

B = LevelContext(bandwidth=1e9)


def load(*, first: bool = False, last: bool = False, compute: float = 0.3,
         parameters: float = 1e8, input_bytes: float = 1e8, output_bytes: float = 5e7,
         activations: float = 0.0) -> StageLoad:
    return StageLoad(compute_s=compute, parameter_bytes=parameters,
                     activation_bytes=activations, input_bytes=0.0 if first else input_bytes,
                     output_bytes=0.0 if last else output_bytes, is_first=first, is_last=last)


def test_the_formula_by_hand() -> None:
    # compute and all-reduce: (0.3 + 4 * 3 * 1e8 / (1e9 * 4)) / 4 = (0.3 + 0.3) / 4
    assert MODEL.stage_time(load(first=True), replicas=4, level=B) == pytest.approx(0.15)
    # the first stage pays no transfer, even one larger than its compute
    assert MODEL.stage_time(load(first=True, compute=0.1, parameters=0.0), replicas=1,
                            level=B) == pytest.approx(0.1)
    # a middle stage: its input 2 * 1e8 / 1e9 = 0.2 and its output 0.1 on one replica
    assert MODEL.stage_time(load(compute=0.1, parameters=0.0), replicas=1,
                            level=B) == pytest.approx(0.2)
    # a middle stage's output counts: output 2 * 5e8 / 1e9 = 1.0, over 2 replicas
    assert MODEL.stage_time(load(compute=0.1, parameters=0.0, output_bytes=5e8), replicas=2,
                            level=B) == pytest.approx(0.5)
    # the last stage: only its input, 0.2 / 2
    assert MODEL.stage_time(load(last=True, compute=0.1, parameters=0.0), replicas=2,
                            level=B) == pytest.approx(0.1)


def test_outer_levels_divide_the_first_stages_all_reduce_only() -> None:
    outer = LevelContext(bandwidth=1e9, workers_per_unit=4, level_index=1)
    first = MODEL.stage_time(load(first=True, compute=0.0), replicas=2, level=outer)
    later = MODEL.stage_time(load(compute=0.0, input_bytes=0.0, output_bytes=0.0),
                             replicas=2, level=outer)
    assert first == pytest.approx((4 * 1 * 1e8 / (1e9 * 2) / 4) / 2)
    assert later == pytest.approx((4 * 1 * 1e8 / (1e9 * 2)) / 2)


def test_memory_counts_minibatches_in_flight() -> None:
    stage = load(activations=3e8, parameters=1e8)
    assert MODEL.stage_memory(stage, replicas=1, workers_from_stage=4) == 4 * 4e8
    assert MODEL.stage_memory(stage, replicas=3, workers_from_stage=4) == 2 * 4e8
    assert MODEL.stage_memory(stage, replicas=4, workers_from_stage=4) == 4e8


def _random_row(rng: random.Random) -> StageRow:
    first = rng.random() < 0.3
    loads = [
        StageLoad(
            compute_s=rng.random() * rng.choice([0, 1, 10]),
            parameter_bytes=rng.random() * rng.choice([0, 1e6, 1e9, 1e10]),
            activation_bytes=rng.random() * rng.choice([0, 1e8, 1e9]),
            input_bytes=0.0 if first else 4e8,
            output_bytes=rng.random() * 1e9,
            is_first=first,
            is_last=rng.random() < 0.3,
        )
        for _ in range(6)
    ]
    return StageRow.of(loads)


@pytest.mark.parametrize("seed", range(4))
def test_min_replicas_agrees_with_trying_every_count(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        row = _random_row(rng)
        level = LevelContext(bandwidth=rng.choice([1e8, 1e9, 1e10]),
                             workers_per_unit=rng.choice([1, 4]))
        workers = rng.choice([1, 2, 3, 8, 64, 1024])
        k, r = rng.randrange(len(row)), rng.randint(1, workers)
        # limits right at a stage time (exact ties), just off it, and far from it
        limit = MODEL.stage_time(row.load(k), replicas=r, level=level) * rng.choice(
            [1.0, 1 + 1e-12, 1 - 1e-12, 0.5, 2.0])
        at_least = rng.choice([1, 2])
        assert MODEL.min_replicas(
            row, level=level, time_limit=limit, max_replicas=workers, at_least=at_least
        ) == scan_min_replicas(
            MODEL, row, level=level, time_limit=limit, max_replicas=workers, at_least=at_least
        )


@pytest.mark.parametrize("seed", range(2))
def test_memory_replicas_agrees_with_trying_every_count(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        row = _random_row(rng)
        workers = rng.choice([1, 3, 8, 64, 1024])
        after = [rng.randint(0, workers) for _ in range(len(row))]
        k, r = rng.randrange(len(row)), rng.randint(1, workers)
        limit = rng.choice([1e8, 1e9, 1e10, MODEL.stage_memory(
            row.load(k), replicas=r, workers_from_stage=after[k] + r)])
        assert MODEL.memory_replicas(
            row, memory_limit=limit, workers_after=after, max_replicas=workers
        ) == scan_memory_replicas(
            MODEL, row, memory_limit=limit, workers_after=after, max_replicas=workers
        )


def test_min_replicas_reports_none_fitting_as_zero() -> None:
    row = StageRow.of([load(first=True, compute=100.0, parameters=0.0)])
    assert MODEL.min_replicas(row, level=B, time_limit=1.0, max_replicas=8) == [0]
    assert MODEL.min_replicas(row, level=B, time_limit=1.0, max_replicas=100) == [100]
