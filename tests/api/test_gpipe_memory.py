"""GPipe's memory, shown structurally (what is held, not RSS): the micro-batches' outputs
are freed once merged, and a backward keeps no graph or buffer beyond the step."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import pipetrain


class Outputs(nn.Module):
    """A linear layer that keeps weak references to its outputs (which autograd does not
    save: ``addmm`` keeps its input and weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.refs.append(weakref.ref(y))
        return y


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_the_microbatches_outputs_are_freed_once_merged(checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), Outputs())
    reference = copy.deepcopy(model)
    last = model[2]
    gpipe = pipetrain.GPipe(model, [2, 1], chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 4)
    out = gpipe(x)
    gc.collect()
    assert len(last.refs) == 4
    assert all(ref() is None for ref in last.refs)  # only the merged output is alive
    out.square().sum().backward()
    reference(x).square().sum().backward()
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_after_a_step_no_microbatch_state_is_held():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), Outputs())
    gpipe = pipetrain.GPipe(model, [2, 1], chunks=4, checkpoint="except_last")
    gpipe(torch.randn(8, 4)).sum().backward()
    gc.collect()
    assert gpipe._local is not None
    for executor in gpipe._local.executors:
        for stage in executor.stages.values():
            assert stage.in_flight == 0 and stage.graphs_held() == 0
            assert len(stage.gradient_pool) == 0  # default: no buffer kept across steps
    assert all(ref() is None for ref in model[2].refs)
