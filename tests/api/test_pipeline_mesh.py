"""One mesh (pp, dp, tp) and FSDP2 over dp: the math of one process, FSDP's collectives
once per step, sharded checkpoints that reshard, and the combinations refused.

A tiny GPT (tied embeddings across stages, a sequence length that changes every step,
global gradient clipping) trained 5 steps on 2 stages x 2 FSDP replicas gives the losses
and weights of plain training in one process, for every synchronous schedule whose
backwards are whole; then an evaluation that leaves one replica without a sample, a
smaller batch split unevenly over the replicas, and a save that loads into a replicated
run and into one stage sharded over 2 replicas.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers.distributed import run_workers
from helpers.mesh_jobs import fsdp_checks_job, resume_job
from helpers.pipeline_jobs import GPT, GPT_CLIP, gpt_batches, sgd
from pipetrain.api.config import PipelineConfig
from pipetrain.api.fsdp import refuse_local_ties, shared_units
from pipetrain.api.mesh import mesh_record
from pipetrain.models import build_gpt, gpt_loss

pytestmark = pytest.mark.distributed

STEPS = 5
TOLERANCE = 1e-5

CONFIGS: list[dict[str, Any]] = [
    dict(num_stages=2, replicas=2, data_parallel="fsdp", **c) for c in (
        {"schedule": "1f1b", "num_microbatches": 2, "reduce_each_microbatch": True},
        {"schedule": "gpipe", "num_microbatches": 2},
        {"schedule": "interleaved-1f1b", "stages_per_rank": 2, "num_microbatches": 2},
        {"schedule": "looped-bfs", "stages_per_rank": 2, "num_microbatches": 2},
        {"schedule": "1f1b", "num_microbatches": 3, "checkpoint": ("always", "per_layer")},
        {"schedule": "gpipe", "num_microbatches": 2, "checkpoint": "except_last",
         "reshard_after_forward": True},
        {"schedule": "interleaved-1f1b", "stages_per_rank": 2, "num_microbatches": 2,
         "reshard_after_forward": True, "reduce_each_microbatch": True,
         "checkpoint": "per_layer"},
    )
]


def _reference() -> dict[str, Any]:
    """Plain training in one process: 5 steps, an evaluation of one sequence, a step on
    3 sequences, then 2 more steps (the ones a resumed run takes)."""
    model = build_gpt(GPT, seed=3)
    opt = sgd(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = gpt_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), GPT_CLIP)
        opt.step()
        return loss.item()

    def params() -> dict[str, torch.Tensor]:
        return {f"layers.{k}": v.detach().clone() for k, v in model.state_dict().items()}

    out: dict[str, Any] = {"losses": [step(x, y) for x, y in gpt_batches(STEPS)]}
    out["params"] = params()
    x, y = gpt_batches(1, batch=1, first=STEPS)[0]
    with torch.no_grad():
        out["eval"] = float(gpt_loss(model(x), y))
    out["uneven"] = step(*gpt_batches(1, batch=3, first=STEPS)[0])
    out["after_uneven"] = params()
    out["resumed"] = [step(x, y) for x, y in gpt_batches(2, first=STEPS + 1)]
    return out


def _merged(results: list[dict[str, Any]], c: int, key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank_results in results:
        merged.update(rank_results[c][key])
    return merged


def _worst(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert set(params) == set(expected)
    return max(float((params[k] - expected[k]).abs().max()) for k in expected)


def test_fsdp_over_replicas_trains_as_one_process_and_reshards_its_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint")
    reference = _reference()
    results = run_workers(fsdp_checks_job, 4, CONFIGS, STEPS, path, timeout=600)
    failures = []
    for c, config in enumerate(CONFIGS):
        worst = _worst(_merged(results, c, "params"), reference["params"])
        loss_error = max(abs(a - b) for a, b in zip(results[0][c]["losses"], reference["losses"]))
        if worst > TOLERANCE or loss_error > TOLERANCE:
            failures.append(f"{config}: max |param diff| {worst:.2e}, max |loss diff| {loss_error:.2e}")
        for rank, rank_results in enumerate(results):
            got = rank_results[c]
            assert got["losses"] == results[0][c]["losses"]
            assert got["sharded"], f"{config}: rank {rank} holds a parameter that is not sharded"
            # rank g: pipeline rank g // 2, replica g % 2; the mesh's dp row is the layout's
            assert got["mesh"][:2] == (("pp", "dp", "tp"), (2, 2, 1))
            assert got["mesh"][2] == got["dp_ranks"] == (2 * (rank // 2), 2 * (rank // 2) + 1)
            units = got["units"]
            # the step's collectives are actions of its schedule, measured in its timeline
            stages = sorted({int(a[0]) for a in got["collectives"]})
            gathered = [f"{j}{op}" for j in stages for op in ("UNSHARD", "REDUCE", "RESHARD")]
            if config.get("reshard_after_forward"):  # FSDP's hooks gather layer by layer
                gathered = [a for a in gathered if a.endswith("REDUCE")]
            assert sorted(got["collectives"]) == sorted(gathered), (config, got["collectives"])
            assert len(stages) == config.get("stages_per_rank", 1)
            # each backward reduce-scatters its own gradients (M a replica), so that FSDP
            # holds no whole gradient between them (with M > 1 it does otherwise)
            per_unit = config["num_microbatches"] if config.get("reduce_each_microbatch") else 1
            if config.get("reduce_each_microbatch"):
                assert got["held_whole_gradients"] == 0, config
            elif config["num_microbatches"] > 1:
                assert got["held_whole_gradients"] > 0, config
            # a worker's shards are 1 / D of its stages' parameters; between its actions
            # it keeps parameters, gradients and SGD's momentum: with both savings on,
            # shards only, 3 x its stages' parameters / D; gathered once per step, the
            # whole parameters besides
            stage_bytes = got["stage_bytes"]
            assert abs(2 * got["shard_bytes"] - stage_bytes) <= 0.05 * stage_bytes
            formula = 3 * stage_bytes / 2
            if config.get("reshard_after_forward") and config.get("reduce_each_microbatch"):
                assert 0.9 * formula <= got["state_bytes"] <= 1.1 * formula, \
                    (config, got["state_bytes"], formula)
            elif not config.get("reshard_after_forward"):
                assert got["state_bytes"] >= formula + 0.9 * stage_bytes, \
                    (config, got["state_bytes"], formula)
            for gathers, reductions in got["counts"]:
                assert reductions == per_unit * units, \
                    f"{config}: {reductions} reduce-scatters, {units} units"
                if config.get("reshard_after_forward"):
                    assert gathers > units  # gathered again for each forward and backward
                else:
                    assert gathers == units, f"{config}: {gathers} all-gathers, {units} units"
    assert not failures, "\n".join(failures)
    first = [rank_results[0] for rank_results in results]
    for got in first:
        assert abs(got["eval"] - reference["eval"]) < TOLERANCE
        assert abs(got["uneven"] - reference["uneven"]) < TOLERANCE
    assert _worst(_merged(results, 0, "after_uneven"), reference["after_uneven"]) < TOLERANCE
    for got in first:
        assert "the mesh has shape (4, 1, 1) but the configuration needs" in got["mesh_error"]
        assert "init_device_mesh(device_type, (2, 2, 1)" in got["mesh_error"]
    assert all(rank_results[1]["same_mesh"] for rank_results in results)
    whole = first[0]["full_state_dict"]  # rank 0's: every tensor of the model, gathered
    assert all(got["full_state_dict"] is None for got in first[1:])
    assert _worst({k: v for k, v in whole.items() if k in reference["after_uneven"]},
                  reference["after_uneven"]) < TOLERANCE

    # the sharded checkpoint (6 steps) into 2 stages, into 1 stage replicated twice, and
    # into 2 stages sharded over 2 replicas again (another schedule)
    for config in ({"num_stages": 2, "num_microbatches": 3},
                   {"num_stages": 1, "replicas": 2, "num_microbatches": 2},
                   {"num_stages": 2, "replicas": 2, "data_parallel": "fsdp", "schedule": "gpipe",
                    "num_microbatches": 1}):
        world = 4 if config.get("data_parallel") == "fsdp" else 2
        for losses, step in run_workers(resume_job, world, config, path, 2, timeout=300):
            assert step == STEPS + 1
            assert max(abs(a - b) for a, b in zip(losses, reference["resumed"])) < TOLERANCE, config


@pytest.mark.parametrize(("values", "expected"), [
    ({"schedule": "zb-h1"}, "splits each backward"),
    ({"schedule": "zb-v", "stages_per_rank": 2}, "splits each backward"),
    ({"schedule": "pipedream", "nonfinite": "ignore"}, "several weight versions"),
    ({"mixed_precision": "bf16"}, "not available yet"),
    ({"stage_replicas": (2, 1), "replicas": 1}, "same number of replicas"),
])
def test_fsdp_refuses_what_it_cannot_run(values: dict[str, Any], expected: str) -> None:
    config = {"num_stages": 2, "replicas": 2, "data_parallel": "fsdp"} | values
    with pytest.raises(ValueError, match=expected) as error:
        PipelineConfig(**config)
    assert "fix:" in str(error.value)


def test_mesh_settings_are_checked_and_recorded() -> None:
    with pytest.raises(ValueError, match="must be one of replicate, fsdp"):
        PipelineConfig(data_parallel="zero")
    with pytest.raises(ValueError, match="reshard_after_forward=True is an FSDP option"):
        PipelineConfig(reshard_after_forward=True)
    with pytest.raises(ValueError, match="reduce_each_microbatch=True is an FSDP option"):
        PipelineConfig(replicas=2, reduce_each_microbatch=True)
    with pytest.raises(ValueError, match="tensor_parallel=0 must be a positive integer"):
        PipelineConfig(tensor_parallel=0)
    config = PipelineConfig(num_stages=2, replicas=2, data_parallel="fsdp")
    assert config.world_size == 4
    assert mesh_record(config) == {"pp": 2, "dp": 2, "tp": 1, "world_size": 4,
                                   "data_parallel": "fsdp", "reshard_after_forward": False,
                                   "reduce_each_microbatch": False}
    config = PipelineConfig(num_stages=2, replicas=2, tensor_parallel=2)
    assert config.world_size == 8 and mesh_record(config)["tp"] == 2


def test_fsdp_refuses_tied_copies_on_one_rank() -> None:
    first, last = nn.Linear(2, 2), nn.Linear(2, 2)
    last.weight = first.weight
    assert shared_units({0: first, 1: nn.Linear(2, 2), 2: nn.GELU(), 3: last}) == [[0, 3], [1]]
    tie = ((0, "token.weight"), (4, "proj.weight"))
    refuse_local_ties([tie], stage_to_rank=(0, 1), layer_ranges=(range(0, 3), range(3, 5)))
    with pytest.raises(ValueError, match=r"2 copies on pipeline rank 0.*fix: more stages"):
        refuse_local_ties([tie], stage_to_rank=(0,), layer_ranges=(range(0, 5),))
