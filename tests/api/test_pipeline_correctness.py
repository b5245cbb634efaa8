"""Multi-process pipelines give the weights of single-process training (gloo, CPU).

For K in {2, 4} stages, every schedule, every checkpoint mode and M in {K, 2K+1}
micro-batches with an uneven batch, the parameters after 3 optimizer steps equal those
of plain training of the same model on the same batches (the schedules added with the
V placement and the looped breadth-first order take one M per mode, and user schedules
from files run in the same job). Each test starts one gloo job and runs all its
configurations in it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers.distributed import run_workers
from helpers.pipeline_jobs import (
    gpt_eval_job,
    gpt_eval_reference,
    gpt_job,
    gpt_reference,
    masked_job,
    masked_reference,
    mlp_job,
    mlp_reference,
)

pytestmark = pytest.mark.distributed

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
NEW_SCHEDULES = ("looped-bfs", "zb-h2", "zb-v", "v-half", "v-min", "dualpipe-v")
CHECKPOINTS = ("never", "except_last", "always")
TOLERANCE = 1e-5

# a hand-made 1F1B variant: the last stage splits its backward and keeps every W for the end
HAND_MADE = """
# 1F1B, the last stage's weight gradients deferred to the end of the step
rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
rank 1: 1F0 1I0 1F1 1I1 1F2 1I2 1F3 1I3 1W0 1W1 1W2 1W3
"""


def _configs(num_stages: int) -> list[dict[str, Any]]:
    per_rank = {"interleaved-1f1b": 2, "looped-bfs": 2, "zb-v": 2, "v-half": 2, "v-min": 2,
                "dualpipe-v": 2}
    old = [
        {"schedule": schedule, "num_stages": num_stages, "checkpoint": checkpoint,
         "num_microbatches": m, "stages_per_rank": per_rank.get(schedule, 1)}
        for schedule in SCHEDULES for checkpoint in CHECKPOINTS
        for m in (num_stages, 2 * num_stages + 1)
    ]
    new = [
        {"schedule": schedule, "num_stages": num_stages, "checkpoint": checkpoint,
         "num_microbatches": num_stages if checkpoint == "except_last" else 2 * num_stages + 1,
         "stages_per_rank": per_rank.get(schedule, 1)}
        for schedule in NEW_SCHEDULES for checkpoint in CHECKPOINTS
    ]
    # without a step check the mean loss takes an all-reduce of its own (with one, the
    # check's all-reduce sums the losses too)
    unchecked = [{"schedule": "1f1b", "num_stages": num_stages, "nonfinite": "ignore",
                  "num_microbatches": 2 * num_stages + 1}]
    return old + new + unchecked


def _user_configs(folder: Path, num_stages: int) -> list[dict[str, Any]]:
    """User schedules from files: compute-only (the library adds messages and steps) and
    fully lowered as ``print`` writes them, with the V placement too."""
    from pipetrain.schedule import build_schedule, zb_v

    files = {"printed-1f1b.txt": str(build_schedule("1f1b", num_ranks=num_stages, num_microbatches=5,
                                                    optimizer_step=True, reduce=True)),
             "printed-zb-v.txt": str(zb_v(num_stages, 5))}
    if num_stages == 2:
        files["hand-made.txt"] = HAND_MADE
    configs = []
    for name, text in files.items():
        (folder / name).write_text(text)
        v_shaped = "zb-v" in name
        configs.append({"schedule": str(folder / name), "num_stages": num_stages,
                        "stages_per_rank": 2 if v_shaped else 1, "checkpoint": "except_last",
                        "num_microbatches": 4 if name == "hand-made.txt" else 5})
    return configs


def _check(results: list[Any], configs: list[dict[str, Any]], reference: Any) -> None:
    ref_params, ref_losses = reference
    failures = []
    for c, config in enumerate(configs):
        merged: dict[str, Any] = {}
        for rank_results in results:
            merged.update(rank_results[c][0])
        assert set(merged) == set(ref_params), f"{config}: parameters {set(ref_params) ^ set(merged)}"
        worst = max(float((merged[k] - ref_params[k]).abs().max()) for k in ref_params)
        losses = results[0][c][1]
        loss_error = max(abs(a - b) for a, b in zip(losses, ref_losses))
        if worst > TOLERANCE or loss_error > TOLERANCE:
            failures.append(f"{config}: max |param diff| {worst:.2e}, max |loss diff| {loss_error:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_every_schedule_and_checkpoint_mode_matches_single_process(
    num_stages: int, tmp_path: Path
) -> None:
    configs = _configs(num_stages) + _user_configs(tmp_path, num_stages)
    batch = 2 * (2 * num_stages + 1) + 1  # uneven micro-batches for every M
    results = run_workers(mlp_job, num_stages, configs, 3, batch, timeout=300)
    _check(results, configs, mlp_reference(3, batch))


def test_clipping_by_the_global_norm_counts_every_stage() -> None:
    """Without ties or replicas a stage's gradient norm is taken at its REDUCE, the rest
    at the step: the clipped weights still equal plain training's, on one stage and two
    per rank."""
    clip = 0.05  # below every step's norm: each step is clipped
    configs = [
        {"schedule": schedule, "num_stages": 2, "num_microbatches": 5, "clip_grad_norm": clip,
         "stages_per_rank": per_rank}
        for schedule, per_rank in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2))
    ]
    results = run_workers(mlp_job, 2, configs, 3, 11, timeout=300)
    reference = mlp_reference(3, 11, clip=clip)
    assert reference[1][1:] != mlp_reference(3, 11)[1][1:]  # the clip changes the training
    _check(results, configs, reference)


def test_replicas_ties_and_changing_sequence_length_match_single_process() -> None:
    """D=2 replicas x K=2 stages, tied embeddings across the first and last stage,
    global gradient clipping, a sequence length that changes every step."""
    configs = [
        {"num_stages": 2, "replicas": 2, "num_microbatches": 3, "schedule": "1f1b"},
        {"num_stages": 2, "replicas": 2, "num_microbatches": 2, "schedule": "interleaved-1f1b",
         "stages_per_rank": 2},
        {"num_stages": 2, "replicas": 2, "num_microbatches": 3, "schedule": "zb-h1",
         "checkpoint": "always"},
        {"num_stages": 4, "num_microbatches": 5, "schedule": "1f1b", "checkpoint": "except_last"},
        {"num_stages": 4, "num_microbatches": 4, "schedule": "gpipe"},
        # the V: the tied embedding and head both on pipeline rank 0
        {"num_stages": 2, "replicas": 2, "num_microbatches": 3, "schedule": "zb-v",
         "stages_per_rank": 2, "checkpoint": "except_last"},
    ]
    results = run_workers(gpt_job, 4, configs, 4, timeout=300)
    _check(results, configs, gpt_reference(4))


def test_v_placement_evaluates_like_one_process() -> None:
    """eval_step runs the forward-only schedule on the V placement: the output (gathered
    from rank 0, which holds the last stage) and the loss of the whole model."""
    expected_output, expected_loss = gpt_eval_reference()
    config = {"num_stages": 2, "schedule": "dualpipe-v", "stages_per_rank": 2, "num_microbatches": 4}
    for output, loss in run_workers(gpt_eval_job, 2, config, timeout=120):
        assert (output - expected_output).abs().max() < TOLERANCE
        assert abs(loss - expected_loss) < TOLERANCE


def test_stages_with_different_replica_counts_match_single_process() -> None:
    """PipeDream's layouts: stage 0 on two processes and stage 1 on one (2-1), and 1-2;
    micro-batches round-robin over a stage's replicas, each stage's gradients summed in
    its own replica group, tied embeddings across stages with different replica counts,
    global clipping. The last stage's replicas' outputs are gathered in order."""
    configs = [
        {"num_stages": 2, "stage_replicas": replicas, "num_microbatches": 3, "schedule": s,
         "checkpoint": c}
        for replicas in ((2, 1), (1, 2)) for s in ("gpipe", "1f1b") for c in ("never", "except_last")
    ]
    results = run_workers(gpt_job, 3, configs, 3, timeout=300)
    _check(results, configs, gpt_reference(3))
    expected_output, expected_loss = gpt_eval_reference()
    for output, loss in run_workers(gpt_eval_job, 3, {"num_stages": 2, "stage_replicas": (1, 2),
                                                        "num_microbatches": 3}, timeout=120):
        assert (output - expected_output).abs().max() < TOLERANCE
        assert abs(loss - expected_loss) < TOLERANCE


def test_stage_boundary_carrying_a_dict_with_an_integer_mask() -> None:
    configs = [
        {"num_stages": 2, "num_microbatches": 3, "schedule": s, "checkpoint": c}
        for s in ("1f1b", "zb-h1") for c in ("never", "always")
    ]
    results = run_workers(masked_job, 2, configs, 3, timeout=300)
    _check(results, configs, masked_reference(3))


def test_per_stage_and_selective_recomputation_and_offload_match_single_process() -> None:
    """One mode per stage, selective recomputation (matrix products kept, the rest
    recomputed from them in backward), per-layer recomputation, activation offload, on 1F1B, ZB-V (split backward)
    and the capped V schedules: the GPT's weights and losses of one process."""
    v = {"num_stages": 2, "stages_per_rank": 2, "num_microbatches": 4}
    configs = [
        {"num_stages": 2, "num_microbatches": 3, "schedule": "1f1b", "checkpoint": "selective"},
        {"num_stages": 2, "num_microbatches": 3, "schedule": "1f1b",
         "checkpoint": ("always", "selective")},
        {**v, "schedule": "zb-v", "checkpoint": "selective"},
        {**v, "schedule": "zb-v", "checkpoint": ("selective", "always", "never", "except_last")},
        {**v, "schedule": "v-half", "checkpoint": "always,selective,except_last,never"},
        {**v, "schedule": "v-min", "checkpoint": "selective"},
        {"num_stages": 2, "num_microbatches": 3, "schedule": "1f1b", "checkpoint": "per_layer"},
        {**v, "schedule": "zb-v", "checkpoint": ("per_layer", "always", "selective", "never")},
        # activation offload (on the CPU the host is the device: the path runs, nothing moves)
        {"num_stages": 2, "num_microbatches": 3, "schedule": "1f1b", "offload": 0},
        {**v, "schedule": "zb-v", "offload": (0, None, 0.01, 0),
         "checkpoint": ("never", "selective", "never", "except_last")},
        {**v, "schedule": "v-half", "offload": 0, "checkpoint": "except_last"},
    ]
    results = run_workers(gpt_job, 2, configs, 3, timeout=300)
    _check(results, configs, gpt_reference(3))
