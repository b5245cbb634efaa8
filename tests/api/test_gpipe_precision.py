"""GPipe under mixed precision equals the unpipelined model run micro-batch by micro-batch
under the same autocast, in every checkpoint mode, and trains with torch.amp.GradScaler.

Tolerance: 1e-5 of the expected values' scale, as in the Pipeline's precision test: both
sides run the same ops on the same micro-batches in the same dtypes; only the order in
which float32 weight gradients of the micro-batches are summed may differ. The reference
runs with one intra-op thread, as each CPU partition does: with two, some CPU kernels
round differently, which a low-precision dtype magnifies to one unit of its last place.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from helpers.gpipe import assert_close, leaf, mlp, pipelined
from pipetrain.microbatch import split_batch

TOLERANCE = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(model: nn.Sequential, x: torch.Tensor, chunks: int, dtype: torch.dtype) -> torch.Tensor:
    """One autocast region per micro-batch, as a partition runs it. (One region around
    all of them would cast each weight once, so autograd would sum the micro-batches'
    weight gradients in the low dtype before casting them to float32: less precise than
    what the pipeline computes, by up to 1e-4 here.)"""
    pieces = []
    for piece in split_batch(x, chunks):
        with torch.autocast("cpu", dtype=dtype):
            pieces.append(model(piece))
    return torch.cat(pieces)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_autocast_in_every_partition_and_its_recomputation(precision: str, checkpoint: str) -> None:
    model = mlp(3, width=16, num_layers=7)
    pipe = pipelined(model, [3, 2, 2], chunks=4, checkpoint=checkpoint, mixed_precision=precision)
    x = torch.randn(10, 5)
    expected_x, got_x = leaf(x), leaf(x)
    expected = _reference(model, expected_x, 4, DTYPES[precision])
    got = pipe(got_x)
    assert got.dtype == expected.dtype  # the last layer (a Sigmoid on a low-precision linear)
    assert_close(got, expected, rtol=TOLERANCE, what="output")
    (expected.float().square().mean()).backward()
    (got.float().square().mean()).backward()
    assert_close(got_x.grad, expected_x.grad, rtol=TOLERANCE, what="input gradient")
    for (name, a), b in zip(pipe.named_parameters(), model.parameters()):
        assert a.dtype == torch.float32  # master weights stay float32
        assert_close(a.grad, b.grad, rtol=TOLERANCE, what=name)
    # autocast did change the result: float32 is farther away than the tolerance
    with torch.no_grad():
        assert (model(x) - expected.float()).abs().max() > 10 * TOLERANCE


def test_fp16_training_with_grad_scaler_skips_an_overflow_on_every_partition() -> None:
    model = mlp(4, width=16, num_layers=6)
    pipe = pipelined(model, [2, 2, 2], chunks=3, mixed_precision="fp16")
    last = pipe.partitions[2][1]  # a linear layer of the last partition
    poison = {"on": False}
    last.weight.register_hook(lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)
    reference = copy.deepcopy(model)
    reference[4].weight.register_hook(lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)
    runs = []
    for module, forward in ((reference, lambda x: _reference(reference, x, 3, torch.float16)), (pipe, pipe)):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        g = torch.Generator().manual_seed(0)
        scales, unchanged = [], []
        for step in range(4):
            poison["on"] = step == 1
            before = [p.detach().clone() for p in module.parameters()]
            x, y = torch.randn(9, 5, generator=g), torch.rand(9, 16, generator=g)
            loss = (forward(x).float() - y).square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
            unchanged.append(all(torch.equal(b, p) for b, p in zip(before, module.parameters())))
        runs.append((scales, unchanged, [p.detach().clone() for p in module.parameters()]))
    (ref_scales, ref_unchanged, ref_weights), (scales, unchanged, weights) = runs
    assert scales == ref_scales == [256.0, 128.0, 128.0, 256.0]
    assert unchanged == ref_unchanged == [False, True, False, False]  # every partition skipped
    for a, b in zip(weights, ref_weights):
        assert_close(a, b, rtol=TOLERANCE, what="weights")


def test_an_unknown_precision_is_named() -> None:
    with pytest.raises(ValueError, match=r"mixed_precision='float8' is not a mixed precision"):
        pipelined(mlp(0), [3, 3], mixed_precision="float8")
