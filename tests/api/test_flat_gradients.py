"""The buffer a replicated stage all-reduces its gradients in is kept from step to step,
and holds every gradient in parameter order."""

import torch
from torch import nn

from pipetrain.api.optimizer_step import StageOptimizers


def _optimizers(params: list[nn.Parameter]) -> StageOptimizers:
    return StageOptimizers({0: params}, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_the_flat_buffer_is_reused_and_holds_the_gradients_in_order():
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))]
    optimizers = _optimizers(params)
    storages = []
    for step in range(3):
        for k, p in enumerate(params):
            p.grad = torch.full_like(p, float(10 * step + k))
        flat = optimizers._flat_gradients(0, params)
        expected = torch.cat([torch.full((6,), 10.0 * step), torch.full((4,), 10.0 * step + 1)])
        assert torch.equal(flat, expected)
        storages.append(flat.data_ptr())
    assert storages[0] == storages[1] == storages[2]


def test_mixed_dtypes_get_a_fresh_concatenation():
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    optimizers = _optimizers(params)
    for p in params:
        p.grad = torch.ones_like(p)
    first = optimizers._flat_gradients(0, params)
    second = optimizers._flat_gradients(0, params)
    assert first.dtype == torch.float64 and torch.equal(first, torch.ones(5, dtype=torch.float64))
    assert first.data_ptr() != second.data_ptr()
