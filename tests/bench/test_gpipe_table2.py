"""The gpipe_table2 bench case on tiny sizes: the simulated throughput of equal layers
follows the bubble's K x M / (M + K - 1), uneven layers fall short of it, the paper's
rows, and the table from a given worker answer (no processes)."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import tempfile
from pathlib import Path
from typing import Any

import pytest

from pipetrain.bench.case import BenchContext
from pipetrain.bench.cases import gpipe_table2
from pipetrain.bench.cases._gpipe_throughput import LayerCosts, simulated_throughput
from pipetrain.bench.cases.gpipe_table2 import KS, MS, normalized_table, uniform_bound


@pytest.mark.parametrize("name", ["_gpipe_throughput", "gpipe_table2"])
def test_examples(name: str) -> None:
    module = importlib.import_module(f"pipetrain.bench.cases.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def _uniform(m: int, layers: int = 24, batch: int = 32) -> LayerCosts:
    """Equal layers whose cost is proportional to the micro-batch's samples."""
    per_sample = 1e-3
    share = batch // m
    return LayerCosts(forward=(per_sample * share,) * layers,
                      backward=(2 * per_sample * share,) * layers, step=(0.0,) * layers)


def test_equal_layers_follow_the_bubble() -> None:
    table = normalized_table({m: _uniform(m) for m in MS}, batch=32)
    for k in KS:
        for m in MS:
            assert table[(k, m)]["normalized"] == pytest.approx(k * m / (m + k - 1), rel=1e-9)
            assert table[(k, m)]["normalized"] == pytest.approx(uniform_bound(k, m), rel=1e-9)
    # busy M / (M + K - 1) of the step on every stage
    for k in KS:
        for m in MS:
            result = simulated_throughput(_uniform(m), num_stages=k, num_microbatches=m,
                                          batch=32)
            assert 1 - result["bubble"] == pytest.approx(m / (m + k - 1), rel=1e-9)
            assert result["balance"] == [24 // k] * k


def test_uneven_layers_fall_short_and_the_optimizer_step_counts() -> None:
    def uneven(m: int) -> LayerCosts:
        share = 32 // m
        forward = tuple(share * c for c in (8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0))
        return LayerCosts(forward=forward, backward=tuple(2 * f for f in forward),
                          step=(0.0,) * 9)

    table = normalized_table({m: uneven(m) for m in MS}, batch=32)
    assert table[(8, 32)]["normalized"] < 0.7 * uniform_bound(8, 32)  # the first stage holds 8 of 16
    with_step = simulated_throughput(
        dataclasses.replace(_uniform(4), step=(0.5,) * 24), num_stages=2, num_microbatches=4,
        batch=32)
    without = simulated_throughput(_uniform(4), num_stages=2, num_microbatches=4, batch=32)
    assert with_step["makespan"] == pytest.approx(without["makespan"] + 12 * 0.5)


def test_paper_rows_are_table_2_of_the_paper() -> None:
    paper = gpipe_table2.PAPER
    assert paper["Transformer-48"][32] == (1.8, 3.4, 6.3)
    assert paper["Transformer-48"][1] == (1.0, 1.07, 1.3)
    assert paper["AmoebaNet-D (18, 256)"][32] == (1.21, 1.84, 3.48)
    assert paper["AmoebaNet-D (18, 256)"][4] == (1.07, 1.26, 1.72)
    assert all(rows[1][0] == 1.0 for rows in paper.values())  # normalized to K = 2, M = 1


def _answer(specs: tuple[Any, ...]) -> dict[str, Any]:
    profiles = {spec.name: {m: dataclasses.asdict(_uniform(m, layers=16)) for m in MS}
                for spec in specs}
    # M = 4 twice as fast as M = 1, M = 32 as fast as M = 1
    steps = {1: [2.0, 2.2, 1.8], 4: [1.0, 1.1, 0.9], 32: [2.0, 2.0, 2.0]}
    return {"profiles": profiles, "balances": {},
            "step_times": {f"{s.name} M={m}": steps[m] for s in specs for m in MS}}


def test_table_from_a_given_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = gpipe_table2.SIZES["quick"]["specs"]
    monkeypatch.setattr(gpipe_table2, "run_job", lambda *args, **kwargs: [_answer(specs)])
    with tempfile.TemporaryDirectory() as out:
        result = gpipe_table2.run(BenchContext(quick=True, out=Path(out),
                                               progress=lambda line: None))
    (table,) = result.tables
    assert len(table.rows) == len(specs) * len(KS) * len(MS)
    rows = {(r[0], r[1], r[2]): r for r in table.rows}
    assert rows[("GPT", 2, 1)][3:7] == [1.0, 1.0, 1.0, 1.0]
    assert rows[("GPT", 2, 1)][7] == 2.0  # the median step
    assert rows[("GPT", 2, 4)][3] == 2.0 and rows[("GPT", 2, 32)][3] == 1.0
    assert rows[("ResNet", 8, 32)][3] is None  # only K = 2 runs for real
    assert rows[("GPT", 8, 32)][4] == round(uniform_bound(8, 32), 2)  # equal layers
    assert rows[("GPT", 4, 32)][6] == 3.4 and rows[("ResNet", 8, 32)][6] == 3.48
    assert result.data["measured_k2"]["GPT"]["4"]["median_s"] == 1.0


@pytest.mark.parametrize("rounds", [1, 2])
def test_profiles_give_each_layer_at_each_microbatch_size(rounds: int) -> None:
    from pipetrain.bench.cases._gpipe_throughput import ModelSpec, _profile

    spec = ModelSpec(name="GPT", kind="gpt", size=(2, 16, 2, 8), batch=4)
    costs = _profile(spec, [1, 4], warmup=0, repetitions=1, rounds=rounds)
    assert sorted(costs) == [1, 4]
    for c in costs.values():
        assert len(c.forward) == len(c.backward) == len(c.step) == 4  # embedding, 2 blocks, head
        assert all(t > 0 for t in c.forward + c.backward)
        assert c.step[0] > 0  # AdamW over the embedding's weights
