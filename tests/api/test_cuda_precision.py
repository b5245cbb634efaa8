"""Mixed precision on GPUs: GPipe with partitions on one GPU, Pipeline with one process per
GPU (NCCL). Skipped without GPUs; written to run where they are.

Tolerance: 1e-3 of the updates' norm (GPipe: of the values' scale). The pipelined and the
single-process runs execute the same ops on the same micro-batches, but on a GPU the
GEMM library may choose other algorithms for the same shapes on other streams or
threads, which can move a bf16 / fp16 result by one unit in its last place (2^-8);
averaged over a layer's update that stays far below 1e-3.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from helpers.distributed import run_workers
from helpers.gpipe import assert_close, leaf, mlp
from helpers.precision_jobs import POISONED_STEP, STEPS, pipeline_job, reference
from pipetrain import GPipe
from pipetrain.microbatch import split_batch

TOLERANCE = 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpipe_partitions_on_one_gpu_under_autocast(precision: str) -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model = mlp(3, width=64, num_layers=7).cuda()
    pipe = GPipe(copy.deepcopy(model), [3, 2, 2], devices=["cuda:0"] * 3, chunks=4,
                 checkpoint="except_last", mixed_precision=precision)
    x = torch.randn(32, 5, device="cuda")
    expected_x, got_x = leaf(x), leaf(x)
    pieces = []
    for piece in split_batch(expected_x, 4):
        with torch.autocast("cuda", dtype=dtype):
            pieces.append(model(piece))
    expected = torch.cat(pieces)
    got = pipe(got_x)
    assert got.dtype == expected.dtype == dtype
    assert_close(got, expected, rtol=TOLERANCE, what="output")
    expected.float().square().mean().backward()
    got.float().square().mean().backward()
    assert_close(got_x.grad, expected_x.grad, rtol=TOLERANCE, what="input gradient")
    for (name, a), b in zip(pipe.named_parameters(), model.parameters()):
        assert_close(a.grad, b.grad, rtol=TOLERANCE, what=name)


def _update_difference(weights: dict[str, torch.Tensor], expected: dict[str, Any]) -> float:
    return max(((weights[k] - expected["weights"][k]).norm()
                / (expected["weights"][k] - expected["initial"][k]).norm()).item() for k in weights)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.distributed
def test_pipeline_over_nccl_under_autocast_and_a_global_overflow() -> None:
    configs = [{"num_stages": 2, "num_microbatches": 4, "schedule": "1f1b", "mixed_precision": "bf16"},
               {"num_stages": 2, "num_microbatches": 4, "schedule": "gpipe", "checkpoint": "always",
                "mixed_precision": "fp16", "poison": True}]
    outcome = run_workers(pipeline_job, 2, [dict(c) for c in configs], [1], timeout=300)
    for index, config in enumerate(configs):
        poison = bool(config.get("poison"))
        expected = reference(str(config["mixed_precision"]), 4, poison=poison, device="cuda:0")
        merged: dict[str, torch.Tensor] = {}
        for rank, results in enumerate(outcome):
            got = results[index]
            merged.update(got["weights"])
            assert got["losses"] == pytest.approx(expected["losses"], rel=TOLERANCE), (config, rank)
            skipped = [poison and step == POISONED_STEP for step in range(STEPS)]
            assert got["skipped"] == skipped and got["changed"] == [not s for s in skipped], rank
            if poison:
                assert got["scales"] == expected["scales"], rank
        assert _update_difference(merged, expected) <= TOLERANCE, config
