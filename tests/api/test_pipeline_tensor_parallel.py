"""Tensor parallelism on the mesh's tp dimension: (P, D, T) = (2, 1, 2), (2, 2, 2) replicated
and (2, 2, 2) with FSDP give the losses and weights of one process, and a checkpoint saved
at (2, 2, 2) resumes at (2, 1, 1) and (1, 1, 2) with one process's next losses.

Two models: pipetrain's GPT with its plan (:mod:`pipetrain.models.gpt_tp`: tied embeddings
across stages, a sequence length that changes every step, global clipping), and residual
MLP blocks split by a user's plan of ``parallelize_module`` styles (up column-wise, down
row-wise) between two linear layers the plan leaves whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import mesh_jobs
from helpers.distributed import run_workers
from helpers.pipeline_jobs import gpt_reference
from helpers.tp_jobs import reference, tp_job
from pipetrain.api.config import PipelineConfig

pytestmark = pytest.mark.distributed

STEPS = 4
TOLERANCE = 1e-5


def _check(results: list[list[dict[str, Any]]], configs: list[dict[str, Any]]) -> None:
    params, losses, evaluated = reference(STEPS)
    failures = []
    for c, config in enumerate(configs):
        merged: dict[str, Any] = {}
        for rank_results in results:
            merged.update(rank_results[c]["params"])
        assert set(merged) == set(params)
        worst = max(float((merged[k] - params[k]).abs().max()) for k in params)
        loss_error = max(abs(a - b) for a, b in zip(results[0][c]["losses"], losses))
        if worst > TOLERANCE or loss_error > TOLERANCE:
            failures.append(f"{config}: max |param diff| {worst:.2e}, max |loss diff| {loss_error:.2e}")
        for rank_results in results:
            got = rank_results[c]
            assert got["losses"] == results[0][c]["losses"]
            assert abs(got["eval"] - evaluated) < TOLERANCE
            # the blocks' up and down weights and up's bias are split; norms, the rest whole
            assert got["split"] and all(n.endswith(("up.weight", "up.bias", "down.weight"))
                                        for n in got["split"])
    assert not failures, "\n".join(failures)


def test_a_users_plan_splits_blocks_as_one_process_computes() -> None:
    configs = [dict(num_stages=2, tensor_parallel=2, num_microbatches=3, **c) for c in (
        {"schedule": "1f1b"},
        {"schedule": "gpipe", "checkpoint": "always"},
    )]
    _check(run_workers(tp_job, 4, configs, STEPS, timeout=300), configs)


def _check_gpt(results: list[Any], configs: list[dict[str, Any]], steps: int) -> None:
    params, losses = gpt_reference(steps)
    for c, config in enumerate(configs):
        merged: dict[str, Any] = {}
        for rank_results in results:
            merged.update(rank_results[c][0])
        assert set(merged) == set(params)
        worst = max(float((merged[k] - params[k]).abs().max()) for k in params)
        loss_error = max(abs(a - b) for a, b in zip(results[0][c][1], losses))
        assert worst < TOLERANCE and loss_error < TOLERANCE, (config, worst, loss_error)


def test_the_gpt_plan_at_2_1_2_trains_as_one_process() -> None:
    """Every synchronous schedule not run with FSDP (tests/api/test_pipeline_mesh.py) runs
    here, the ones that split backwards into input and weight halves included."""
    configs = [{"num_stages": 2, "tensor_parallel": 2, "num_microbatches": 2, **c} for c in (
        {"schedule": "1f1b"},
        {"schedule": "interleaved-1f1b", "stages_per_rank": 2, "checkpoint": "except_last"},
        {"schedule": "zb-h1", "checkpoint": "per_layer"},
        {"schedule": "zb-h2", "num_microbatches": 3},
        {"schedule": "zb-v", "stages_per_rank": 2},
        {"schedule": "dualpipe-v", "stages_per_rank": 2, "num_microbatches": 4},
        # sequence parallelism inside the blocks (lengths 16, 9, 12, 5: uneven shards too)
        {"schedule": "1f1b", "sequence_parallel": True},
        {"schedule": "zb-h1", "checkpoint": "always", "sequence_parallel": True},
    )]
    results = run_workers(mesh_jobs.fsdp_job, 4, configs, 5, timeout=300)
    _check_gpt(results, configs, 5)
    # the norms saw every rank's share of the positions (16, 9, 12, 5: 8, 5 or 4, 6, 3 or 2)
    # with sequence parallelism, the whole sequences without it
    for rank_results in results:
        assert rank_results[0][2] == [5, 9, 12, 16]
        assert set(rank_results[-1][2]) <= {2, 3, 4, 5, 6, 8} and 8 in rank_results[-1][2]


def test_the_gpt_at_2_2_2_replicated_and_fsdp_and_its_checkpoint_reshards(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint")
    configs = [dict(num_stages=2, replicas=2, tensor_parallel=2, num_microbatches=1, **c) for c in (
        {"data_parallel": "replicate"},
        {"data_parallel": "fsdp", "schedule": "gpipe"},
    )]
    _check_gpt(run_workers(mesh_jobs.fsdp_job, 8, configs, 5, path, timeout=400), configs, 5)
    expected = gpt_reference(7)[1][5:]  # the two steps after the checkpoint
    for config in ({"num_stages": 2, "num_microbatches": 2},
                   {"num_stages": 1, "tensor_parallel": 2, "num_microbatches": 2}):
        for losses, step in run_workers(mesh_jobs.resume_job, 2, config, path, 2, timeout=300):
            assert step == 5
            assert max(abs(a - b) for a, b in zip(losses, expected)) < TOLERANCE, config


@pytest.mark.parametrize(("values", "expected"), [
    ({"schedule": "pipedream"}, "schedule 'pipedream' is not available yet"),
    ({"mixed_precision": "bf16"}, "mixed_precision='bf16' is not available yet"),
    ({"stage_replicas": (2, 1)}, "needs the same number of replicas"),
])
def test_tensor_parallel_refuses_what_it_cannot_run(values: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        PipelineConfig(num_stages=2, tensor_parallel=2, **values)


def test_a_plan_is_needed_and_applies_to_layers_not_captured_units() -> None:
    from pipetrain.api.tensor_parallel import parallelize_stages, styles_plan

    with pytest.raises(ValueError, match="tensor_parallel=2 needs a plan"):
        parallelize_stages({}, None, mesh=None, tensor_parallel=2)
    with pytest.raises(ValueError, match="with a captured model"):
        parallelize_stages({}, styles_plan({}), mesh=None, tensor_parallel=2, captured=True)
    with pytest.raises(ValueError, match="has tensor_parallel=1"):
        parallelize_stages({}, styles_plan({}), mesh=None, tensor_parallel=1)


def test_every_rank_creates_the_link_groups_of_every_tensor_parallel_index() -> None:
    """The GPU transport's groups (one per link direction) are created by every rank for
    every tp index's placement in one order: rank g's links are to g +- 2 only."""
    results = run_workers(mesh_jobs.link_groups_job, 4, timeout=120)
    assert results == [[(0, 2), (2, 0)], [(1, 3), (3, 1)], [(0, 2), (2, 0)], [(1, 3), (3, 1)]]


def test_hugging_face_llama_layers_compute_the_model_and_refuse_what_they_cannot_split() -> None:
    """The layers run the model's own modules (its logits exactly); a tied model and heads
    that do not divide among the ranks are refused with the fix."""
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import llama_jobs
    from pipetrain.models.llama_layers import llama_layers, llama_tensor_parallel_plan

    model = llama_jobs.llama()
    x, _ = llama_jobs.batches(1)[0]
    layers = nn.Sequential(*(factory() for factory in llama_layers(model)))
    assert torch.equal(layers(x), model(input_ids=x).logits)
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        tie_word_embeddings=True))
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        llama_layers(tied)
    with pytest.raises(ValueError, match="not a Llama causal language model"):
        llama_layers(nn.Linear(2, 2))

    class ThreeRanks:
        def size(self) -> int:
            return 3

    with pytest.raises(ValueError, match="must divide among 3 tensor-parallel ranks"):
        llama_tensor_parallel_plan(1, layers[1], ThreeRanks())  # type: ignore[arg-type]


def test_hugging_face_llama_at_2_1_2_and_2_2_2_fsdp_trains_as_one_process() -> None:
    """Grouped-query attention split by heads, the MLP by its width, sequence lengths that
    change between steps: the losses and weights of one process."""
    from helpers import llama_jobs

    params, losses = llama_jobs.reference(4)
    runs = [(4, [dict(num_stages=2, tensor_parallel=2, num_microbatches=2, schedule="1f1b")]),
            (8, [dict(num_stages=2, replicas=2, tensor_parallel=2, num_microbatches=1,
                      data_parallel="fsdp", schedule="gpipe")])]
    for world, configs in runs:
        results = run_workers(llama_jobs.tp_job, world, configs, 4, timeout=300)
        merged: dict[str, Any] = {}
        for rank_results in results:
            merged.update(rank_results[0][0])
        assert set(merged) == set(params)
        worst = max(float((merged[k] - params[k]).abs().max()) for k in params)
        loss_error = max(abs(a - b) for a, b in zip(results[0][0][1], losses))
        assert worst < TOLERANCE and loss_error < TOLERANCE, (configs, worst, loss_error)
        split = {name.split(".", 3)[-1] for rank_results in results for name in rank_results[0][2]}
        assert split == {f"{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                 "self_attn.v_proj", "self_attn.o_proj",
                                                 "mlp.gate_proj", "mlp.up_proj",
                                                 "mlp.down_proj")}, split


def test_sequence_parallelism_refuses_dropout_and_leaves_other_layers_whole() -> None:
    from pipetrain.models.gpt import Block, GPTConfig, Head
    from pipetrain.models.gpt_tp import gpt_sequence_parallel_plan

    config = GPTConfig(num_layers=1, width=8, num_heads=2, context=4, dropout=0.1)
    with pytest.raises(ValueError, match=r"sequence parallelism with dropout 0\.1.*fix: dropout 0\.0"):
        gpt_sequence_parallel_plan(1, Block(config), None)  # type: ignore[arg-type]
    head = Head(config)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    assert gpt_sequence_parallel_plan(2, head, None) is None  # type: ignore[arg-type,func-returns-value]
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items())
    assert not head._forward_pre_hooks and not head._forward_hooks


def test_sequence_parallelism_shrinks_what_a_block_keeps_for_its_backward() -> None:
    """Measured with saved-tensor hooks (each storage once, parameters left out): the norms'
    inputs are each rank's share of the positions (width 64, 4 x 64 positions, T = 2:
    692,224 bytes against 759,808; the gathered inputs of attn.qkv and mlp.fc stay whole)."""
    for saved in run_workers(mesh_jobs.saved_bytes_job, 2, 4, 64, timeout=120):
        assert saved["sp"] <= 0.92 * saved["tp"], saved
        norms = 2 * 4 * 64 * 64 * 4 // 2  # half of both norms' (B, T, C) float32 inputs
        assert saved["tp"] - saved["sp"] >= norms, saved
