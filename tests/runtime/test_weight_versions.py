"""A stage's weight versions: forwards with older versions, backwards with the forward's
weights across updates, what is kept and dropped, and no graph kept alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from pipetrain.runtime.weight_versions import StageVersions, VersionUse
from pipetrain.schedule import Op


def _layer() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 3)


def _step(layer: nn.Linear) -> None:
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(1.0)  # an optimizer's in-place update


def test_backwards_use_their_forwards_weights_across_updates() -> None:
    """Two micro-batches in flight with versions 0 and 1, two updates meanwhile: each
    backward gives the gradient of the weights its forward used (as plain autograd on
    copies of those weights would)."""
    layer = _layer()
    versions = StageVersions(list(layer.parameters()), stage_index=0, record=[])
    versions.plan([0, 1], after=2)
    copies, outputs, inputs = [], [], []
    for k in range(2):
        copies.append(nn.Linear(3, 3))
        copies[k].load_state_dict(layer.state_dict())
        inputs.append(torch.randn(2, 3, requires_grad=True))
        with versions.computing(Op.FORWARD, k, k):
            outputs.append(torch.tanh(layer(inputs[k])))
        versions.update(lambda: _step(layer))
    assert versions.version == 2 and versions.num_stashed == 2
    for k in range(2):
        expected_input = torch.autograd.grad(torch.tanh(copies[k](inputs[k])).sum(), inputs[k])[0]
        with versions.computing(Op.BACKWARD, k, None):
            grad = torch.autograd.grad(outputs[k].sum(), inputs[k])[0]
        assert torch.allclose(grad, expected_input)
    assert versions.num_stashed == 0 and versions.peak_versions == 3
    assert versions.peak_stashed_bytes == 2 * sum(p.numel() * 4 for p in layer.parameters())
    assert [(r.op, r.microbatch, r.version) for r in versions.record or []] == [
        ("F", 0, 0), ("F", 1, 1), ("B", 0, 0), ("B", 1, 1)]


def test_a_forward_with_an_older_version_and_the_live_weights_after_it() -> None:
    layer = _layer()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    versions = StageVersions(list(layer.parameters()), stage_index=0)
    versions.plan([0], after=0)  # a later forward still uses version 0: kept at the update
    versions.update(lambda: _step(layer))
    x = torch.randn(2, 3)
    with versions.computing(Op.FORWARD, 0, 0):
        old = layer(x)
    assert torch.allclose(old, torch.nn.functional.linear(x, before["weight"], before["bias"]))
    assert torch.equal(layer.weight, before["weight"] + 1)  # the live weights are back
    with torch.no_grad(), versions.computing(Op.FORWARD, 7, None):  # evaluation: the next forward's
        assert torch.allclose(layer(x), old)
    assert versions.num_stashed == 1  # still planned for a later forward


def test_what_is_not_needed_is_not_kept() -> None:
    layer = _layer()
    versions = StageVersions(list(layer.parameters()), stage_index=0)
    versions.plan([0], after=2)  # the next forward comes after two updates
    with versions.computing(Op.FORWARD, 0, 0):
        y = layer(torch.randn(1, 3, requires_grad=True))
    versions.update(lambda: _step(layer))  # micro-batch 0 still needs version 0
    assert versions.num_stashed == 1
    with versions.computing(Op.BACKWARD, 0, 0):
        y.sum().backward()
    assert versions.num_stashed == 0
    versions.update(lambda: _step(layer))  # nothing needs version 1: updated in place
    assert versions.num_stashed == 0 and versions.peak_versions == 2


def test_no_graph_stays_alive_after_its_backward() -> None:
    """Regression: an output saved for backward (tanh saves its result) was packed as is,
    a cycle through its grad_fn; a backward that retains part of the graph (the split and
    fused backward's input pass does) then kept every micro-batch's graph alive."""
    layer = _layer()
    versions = StageVersions(list(layer.parameters()), stage_index=0)
    versions.plan([0], after=0)
    x = torch.randn(2, 3, requires_grad=True)
    with versions.computing(Op.FORWARD, 0, 0):
        y = torch.tanh(layer(x))
    alive = weakref.ref(y)
    with versions.computing(Op.BACKWARD, 0, None):
        torch.autograd.grad(y.sum(), x, retain_graph=True)
    del y
    gc.collect()
    assert alive() is None


def test_mistakes_are_named() -> None:
    layer = _layer()
    versions = StageVersions(list(layer.parameters()), stage_index=2)
    with versions.computing(Op.FORWARD, 0, 0):
        layer(torch.randn(1, 3))
    with pytest.raises(RuntimeError, match=r"stage 2: B of micro-batch 0 with version 1, but its forward used 0"):
        with versions.computing(Op.BACKWARD, 0, 1):
            pass
    with pytest.raises(RuntimeError, match=r"stage 2: weight version 5 is not kept \(live: 0, stashed: \[\]\)"):
        with versions.computing(Op.FORWARD, 1, 5):
            pass
    assert VersionUse(0, "F", 0, 0, 0.0).op == "F"
