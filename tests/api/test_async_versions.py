"""Asynchronous schedules in the multi-process runtime (gloo, float64 MLP).

Every forward and backward of every micro-batch on every stage is recorded with the
weight version it used and a checksum of those weights. The versions are the papers'
formulas (PipeDream: ``max(0, i - K + j + 1)``, with vertical sync the input stage's;
2BW: ``max(t - 1, 0)`` for step ``t``), a backward uses its forward's weights, and the
weights of version ``v`` are those of the single-process reference after ``v``
updates. The versions a stage keeps are the papers' bound (PipeDream ``K - j``, vertical
sync ``K``, 2BW two), and the trained weights and losses equal the references (1e-6).
One job per world size runs every configuration.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pytest

from helpers.async_jobs import async_job, pipedream_reference, two_bw_reference
from helpers.distributed import run_workers
from pipetrain.schedule import build_schedule, versions_held

pytestmark = pytest.mark.distributed

STEPS, BATCH, M = 4, 8, 4
TOLERANCE = 1e-6


def _configs(num_stages: int) -> list[dict[str, Any]]:
    base = {"num_stages": num_stages, "num_microbatches": M}
    return [
        {"schedule": "pipedream", **base},
        {"schedule": "pipedream", "vertical_sync": True, **base},
        {"schedule": "2bw", **base},
        {"schedule": "pipedream", "checkpoint": "always", **base},  # recomputed with stashed weights
        {"schedule": "pipedream", "vertical_sync": True, "checkpoint": "always", **base},
    ]


JOBS: dict[int, list[dict[str, Any]]] = {
    1: [_configs(1)[0], _configs(1)[2]],
    2: _configs(2),
    3: [{"schedule": "2bw", "num_stages": 2, "stage_replicas": (2, 1), "num_microbatches": M},
        {"schedule": "pipedream", "num_stages": 2, "stage_replicas": (2, 1), "num_microbatches": M}],
    4: _configs(4),
}


@pytest.fixture(scope="module")
def runs() -> dict[int, list[Any]]:
    return {world: run_workers(async_job, world, configs, STEPS, BATCH, timeout=600)
            for world, configs in JOBS.items()}


def _cases(runs: dict[int, list[Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(configuration, per-rank results) of every configuration of every job."""
    return [(config, [rank[c] for rank in runs[world]])
            for world, configs in JOBS.items() for c, config in enumerate(configs)]


def _total(config: dict[str, Any]) -> int:
    return M * (config.get("stage_replicas") or (1,))[0]


def _expected(config: dict[str, Any], stage: int, i: int) -> int:
    """The paper's version of micro-batch ``i`` on ``stage``."""
    if config["schedule"] == "2bw":
        return max(i // _total(config) - 1, 0)
    num_stages = config["num_stages"]
    replicas = config.get("stage_replicas") or (1,) * num_stages
    if config.get("vertical_sync"):
        stage = 0
    warmup = math.ceil(sum(replicas[stage + 1:]) / replicas[stage])  # NOAM - 1 on the input stage
    return max(0, i // replicas[stage] - warmup)


def _records(results: list[dict[str, Any]]) -> dict[tuple[int, str, int], Any]:
    found: dict[tuple[int, str, int], Any] = {}
    for rank in results:
        for r in rank["records"]:
            key = (r.stage, r.op, r.microbatch)
            assert key not in found, f"{key} ran twice"
            found[key] = r
    return found


def test_every_forward_and_backward_uses_the_papers_version(runs: dict[int, list[Any]]) -> None:
    for config, results in _cases(runs):
        records = _records(results)
        num = STEPS * _total(config)
        assert set(records) == {(j, op, i) for j in range(config["num_stages"])
                                for op in "FB" for i in range(num)}, config
        wrong = [(key, r.version, _expected(config, key[0], key[2])) for key, r in records.items()
                 if r.version != _expected(config, key[0], key[2])]
        assert not wrong, f"{config}: (stage, op, micro-batch), used, expected: {wrong[:5]}"


def test_backward_uses_the_weights_of_its_forward(runs: dict[int, list[Any]]) -> None:
    for config, results in _cases(runs):
        records = _records(results)
        for (j, op, i), r in records.items():
            if op == "B":
                forward = records[(j, "F", i)]
                assert (r.version, r.checksum) == (forward.version, forward.checksum), (config, j, i)


def test_vertical_sync_uses_the_input_stages_version_everywhere(runs: dict[int, list[Any]]) -> None:
    cases = [(c, r) for c, r in _cases(runs) if c.get("vertical_sync")]
    assert cases
    for config, results in cases:
        records = _records(results)
        for (j, op, i), r in records.items():
            assert r.version == records[(0, "F", i)].version, (config, j, op, i)


def test_versions_are_the_references_weights(runs: dict[int, list[Any]]) -> None:
    for config, results in _cases(runs):
        if config.get("stage_replicas"):
            continue
        reference = _reference(config)
        for (j, _, i), r in _records(results).items():
            assert r.checksum == pytest.approx(reference["checksums"][j][r.version], abs=1e-9), (config, j, i)


def test_stages_keep_the_papers_number_of_versions(runs: dict[int, list[Any]]) -> None:
    """Measured: live weights plus stashed versions at their most. PipeDream: one per
    micro-batch in flight on the stage (K - j); vertical sync: the input stage's K on
    every stage; 2BW: two. Stashed bytes: the extra versions' parameter bytes."""
    for config, results in _cases(runs):
        num_stages = config["num_stages"]
        schedule = build_schedule(config["schedule"], num_ranks=num_stages, num_microbatches=_total(config),
                                  replicas=config.get("stage_replicas"), num_steps=STEPS,
                                  vertical_sync=config.get("vertical_sync", False))
        held = versions_held(schedule)
        for rank in results:
            for j, peak in rank["peaks"].items():
                if config["schedule"] == "2bw":
                    paper = 2
                elif config.get("vertical_sync"):
                    paper = num_stages
                elif config.get("stage_replicas"):
                    paper = held[(rank["rank"], j)]
                else:
                    paper = num_stages - j
                assert peak == paper == held[(rank["rank"], j)], (config, j, peak, paper)
                assert rank["stashed_bytes"][j] == (peak - 1) * rank["param_bytes"][j], (config, j)


def _reference(config: dict[str, Any]) -> dict[str, Any]:
    if config["schedule"] == "2bw":
        return two_bw_reference(config["num_stages"], steps=STEPS, batch=BATCH, microbatches=_total(config))
    return pipedream_reference(config["num_stages"], vertical_sync=config.get("vertical_sync", False),
                               steps=STEPS, batch=BATCH, microbatches=M)


def test_weights_and_losses_equal_the_single_process_rules(runs: dict[int, list[Any]]) -> None:
    """PipeDream (K = 1, 2, 4, with and without vertical sync and re-materialization)
    equals weight stashing applied per micro-batch; 2BW (K = 1, 2, 4, and stages on
    2 + 1 processes) equals the 2BW rule: the same losses for every K."""
    failures = []
    two_bw_losses: dict[str, list[list[float]]] = defaultdict(list)
    for config, results in _cases(runs):
        if config["schedule"] == "pipedream" and config.get("stage_replicas"):
            continue  # a round of replicas averages their gradients: versions checked above
        reference = _reference(config)
        merged: dict[str, Any] = {}
        for rank in results:
            merged.update(rank["params"])
        assert set(merged) == set(reference["params"]), config
        worst = max(float((merged[k] - reference["params"][k]).abs().max()) for k in merged)
        loss_error = max(abs(a - b) for a, b in zip(results[0]["losses"], reference["losses"]))
        if worst > TOLERANCE or loss_error > TOLERANCE:
            failures.append(f"{config}: max |param diff| {worst:.2e}, max |loss diff| {loss_error:.2e}")
        if config["schedule"] == "2bw":
            two_bw_losses["2bw"].append(results[0]["losses"])
    assert not failures, "\n".join(failures)
    first, *others = two_bw_losses["2bw"]
    assert len(others) == 3 and all(o == pytest.approx(first, abs=TOLERANCE) for o in others)
