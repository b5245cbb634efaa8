"""The benchmarks' shared harness (``pipetrain.bench.harness``): statistics, output, and the
interleaved timing loop on a 2-rank gloo job (a runner on one rank only included)."""

from __future__ import annotations

import doctest
import importlib
import math
import time
from typing import Any

import pytest

from pipetrain.bench.harness import (
    dump_json,
    interleave,
    quartiles,
    run_job,
    step_times,
    summary,
)


@pytest.mark.parametrize("name", ["stats", "output", "machine", "timing", "memory", "noise"])
def test_examples(name: str) -> None:
    module = importlib.import_module(f"pipetrain.bench.harness.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_statistics_and_strict_json() -> None:
    assert quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == [1.5, 4.5]
    assert summary([0.3, 0.1, 0.2]) == {"median_s": 0.2, "quartiles_s": [0.1, 0.3],
                                        "min_s": 0.1, "reps": 3}
    text = dump_json({"x": [1.0, math.nan, math.inf], "s": {3, 1}})
    assert text == '{"x": [1.0, null, null], "s": [1, 3]}'


class _Sleeper:
    """Sleeps ``seconds[rank]`` per step; counts its steps and timed steps."""

    def __init__(self, label: str, seconds: tuple[float, float], ranks: tuple[int, ...] | None):
        self.label = label
        self.seconds = seconds
        self.ranks = ranks
        self.batches: list[int] = []
        self.timed = 0

    def step(self, k: int) -> None:
        import torch.distributed as dist

        self.batches.append(k)
        time.sleep(self.seconds[dist.get_rank()])

    def after_timed_step(self) -> None:
        self.timed += 1


def _job(ctx: Any) -> dict[str, Any]:
    both = _Sleeper("both", (0.01, 0.03), None)
    alone = _Sleeper("alone", (0.02, 0.0), (0,))
    samples, window = interleave([both, alone], lambda k: (k,), reps=3, warmup=2)
    return {"samples": samples, "window": window,
            "batches": {r.label: r.batches for r in (both, alone)},
            "timed": {r.label: r.timed for r in (both, alone)}}


@pytest.mark.distributed
def test_interleave_times_every_runner_on_the_ranks_that_run_it() -> None:
    results = run_job(_job, world_size=2, timeout=120)
    per_rank = [r["samples"] for r in results]
    both, alone = step_times(per_rank, "both"), step_times(per_rank, "alone")
    assert len(both) == len(alone) == 3
    assert all(t >= 0.03 for t in both)  # the slower rank's time
    assert all(0.02 <= t < 0.5 for t in alone)
    assert [s.wall_s is None for s in per_rank[1]["alone"]] == [True] * 3
    assert results[0]["batches"] == {"both": [0, 1, 0, 1, 2], "alone": [0, 1, 0, 1, 2]}
    assert results[1]["batches"]["alone"] == []
    assert results[0]["timed"] == {"both": 3, "alone": 3}
    assert results[1]["timed"] == {"both": 3, "alone": 0}
    assert all(r["window"]["wall_s"] > 0 for r in results)


def test_noise_warnings_name_disagreeing_repetitions_and_a_busy_machine() -> None:
    from pipetrain.bench.harness import load_warning, measurement_warnings, spread_warning

    steady = [0.100, 0.102, 0.101, 0.099, 0.100]
    assert spread_warning("steady", steady) is None
    noisy = spread_warning("noisy", [0.100, 0.150, 0.101, 0.210, 0.100])
    assert noisy is not None and noisy.startswith("noisy: repetitions disagree")
    assert spread_warning("one", [0.1]) is None
    assert load_warning([2.5, 1.0, 1.0], cores=2) is not None
    assert load_warning([1.9, 3.0, 3.0], cores=2) is None  # the 1-minute figure counts
    found = measurement_warnings({"steady": steady, "wide": [1.0, 3.0]},
                                 load_average=[4.0, 4.0, 4.0], cores=2)
    assert len(found) == 2 and found[0].startswith("wide:") and "load average 4.0" in found[1]
