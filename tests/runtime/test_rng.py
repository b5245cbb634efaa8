"""Random streams: every layer seeded from (seed, layer, micro-batch), the caller's state kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.runtime.rng import RandomStreams, generators, seeded_layers
from pipetrain.runtime.stage import StageCompute

CPU = torch.device("cpu")


class FunctionalDropout(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(x), 0.5, training=self.training)


def _layers() -> list[nn.Module]:
    return [FunctionalDropout(i) for i in range(4)]


def _draw(seed: int, microbatch: int, layer: int) -> torch.Tensor:
    with seeded_layers(seed, microbatch, CPU) as enter:
        enter(layer)
        return torch.rand(16)


def test_streams_depend_on_seed_layer_and_microbatch_only() -> None:
    base = _draw(1, 2, 3)
    assert torch.equal(base, _draw(1, 2, 3))
    for other in (_draw(2, 2, 3), _draw(1, 3, 3), _draw(1, 2, 4)):
        assert not torch.equal(base, other)


def test_the_callers_generator_state_is_restored_also_on_error() -> None:
    torch.manual_seed(0)
    before = torch.default_generator.get_state()
    with pytest.raises(ValueError, match="inside"):
        with seeded_layers(1, 0, CPU) as enter:
            enter(0)
            torch.rand(3)
            raise ValueError("inside")
    assert torch.equal(before, torch.default_generator.get_state())


def _run(stages: list[tuple[list[nn.Module], int]], x: torch.Tensor, *,
         checkpointed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and parameter gradients of the layers cut into ``stages`` (layers, first
    layer index), micro-batch 5 of a step seeded 9."""
    streams = RandomStreams(seed=9)
    computes = [StageCompute(nn.Sequential(*layers), stage_index=j, device=CPU, rng=streams,
                             first_layer=first) for j, (layers, first) in enumerate(stages)]
    value = x
    for compute in computes:
        value, _ = compute.forward(5, value.detach().requires_grad_(True), checkpointed=checkpointed)
    grads: list[torch.Tensor | None] = [torch.ones_like(value)]
    for compute in reversed(computes):
        grads = compute.backward(5, grads)
    params = [p for layers, _ in stages for layer in layers for p in layer.parameters()]
    out = value.detach()
    grads_out = [p.grad.clone() for p in params if p.grad is not None]
    for p in params:
        p.grad = None
    return out, grads_out


def test_the_cut_and_the_recomputation_do_not_change_the_masks() -> None:
    """One stage of 4 layers, two of 2 and four of 1, with and without checkpointing:
    the same output and gradients (F.dropout inside a custom layer, no type list)."""
    layers = _layers()
    x = torch.randn(6, 8)
    whole = _run([(layers, 0)], x, checkpointed=False)
    cuts = [
        [(layers[:2], 0), (layers[2:], 2)],
        [([layer], i) for i, layer in enumerate(layers)],
    ]
    for stages in cuts:
        for checkpointed in (False, True):
            out, grads = _run(stages, x, checkpointed=checkpointed)
            assert torch.equal(out, whole[0]), (len(stages), checkpointed)
            assert len(grads) == len(whole[1]) == 8
            for a, b in zip(grads, whole[1]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert (whole[0] == 0).any()  # dropout dropped something


def test_a_stage_leaves_the_callers_generator_as_it_was() -> None:
    layers = _layers()
    x = torch.randn(6, 8)
    torch.manual_seed(3)
    before = torch.default_generator.get_state()
    _run([(layers[:2], 0), (layers[2:], 2)], x, checkpointed=True)
    assert torch.equal(before, torch.default_generator.get_state())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_generators_are_seeded_and_restored() -> None:
    device = torch.device("cuda", 0)
    assert len(generators(device)) == 2
    before = torch.cuda.get_rng_state(device)
    masks = []
    for _ in range(2):
        with seeded_layers(1, 0, device) as enter:
            enter(0)
            masks.append(F.dropout(torch.ones(64, device=device), 0.5))
    assert torch.equal(masks[0], masks[1])
    assert torch.equal(before, torch.cuda.get_rng_state(device))
