"""GPipe is transparent: outputs, input and parameter gradients, and weights after
training equal those of the plain ``nn.Sequential``, for every balance, chunk count and
checkpoint mode."""

from __future__ import annotations

import copy

import pytest
import torch

import pipetrain
from helpers.gpipe import assert_close, assert_grads_close, leaf, mlp, pipelined

BALANCES = [[6], [3, 3], [1, 4, 1], [2, 1, 2, 1]]
MODES = ["always", "except_last", "never"]


@pytest.mark.parametrize("balance", BALANCES, ids=lambda b: f"{len(b)}parts")
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("checkpoint", MODES)
def test_outputs_and_gradients_equal_plain(balance, chunks, checkpoint):
    model = mlp(1)
    gpipe = pipelined(model, balance, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(8, 5)
    x_ref, x_pipe = leaf(x), leaf(x)

    expected = model(x_ref)
    actual = gpipe(x_pipe)
    assert_close(actual, expected, what="output")
    weights = torch.randn_like(expected)  # a loss whose gradient differs per row
    (expected * weights).sum().backward()
    (actual * weights).sum().backward()

    assert_close(x_pipe.grad, x_ref.grad, what="input grad")
    assert_grads_close(gpipe.parameters(), model.parameters())
    assert all(p.grad is not None for p in gpipe.parameters())


@pytest.mark.parametrize("checkpoint", MODES)
def test_uneven_split_10_rows_in_4_chunks(checkpoint):
    model = mlp(2)
    gpipe = pipelined(model, [2, 2, 2], chunks=4, checkpoint=checkpoint)
    x = torch.randn(10, 5)  # micro-batches of 3, 3, 2, 2 rows
    x_ref, x_pipe = leaf(x), leaf(x)
    expected, actual = model(x_ref), gpipe(x_pipe)
    assert_close(actual, expected, what="output")
    expected.pow(2).sum().backward()
    actual.pow(2).sum().backward()
    assert_close(x_pipe.grad, x_ref.grad, what="input grad")
    assert_grads_close(gpipe.parameters(), model.parameters())


def test_batch_smaller_than_chunks():
    model = mlp(3)
    gpipe = pipelined(model, [3, 3], chunks=4)
    x = torch.randn(3, 5)  # 3 micro-batches of one row
    x_ref, x_pipe = leaf(x), leaf(x)
    expected, actual = model(x_ref), gpipe(x_pipe)
    assert_close(actual, expected)
    expected.sum().backward()
    actual.sum().backward()
    assert_close(x_pipe.grad, x_ref.grad)
    assert_grads_close(gpipe.parameters(), model.parameters())


def test_parameters_only_input_without_grad():
    model = mlp(4)
    gpipe = pipelined(model, [3, 3], chunks=2)
    x = torch.randn(6, 5)
    model(x).sum().backward()
    out = gpipe(x)
    assert out.requires_grad
    out.sum().backward()
    assert_grads_close(gpipe.parameters(), model.parameters())


@pytest.mark.parametrize(
    ("optimizer", "checkpoint"),
    [("sgd", "except_last"), ("adam", "always"), ("adam", "never")],
)
def test_training_steps_reach_the_same_weights(optimizer, checkpoint):
    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.Adam(params, lr=0.01)

    model = mlp(5)
    gpipe = pipelined(model, [2, 2, 2], chunks=3, checkpoint=checkpoint)
    opt_ref, opt_pipe = make(model.parameters()), make(gpipe.parameters())
    torch.manual_seed(6)
    batches = [(torch.randn(9, 5), torch.randn(9, 8)) for _ in range(4)]
    for x, target in batches:
        for net, opt in ((model, opt_ref), (gpipe, opt_pipe)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), target)
            loss.backward()
            opt.step()
    moved = [(p - q).abs().max().item() for p, q in zip(model.parameters(), mlp(5).parameters())]
    assert max(moved) > 1e-3  # training changed the weights
    for index, (p, q) in enumerate(zip(gpipe.parameters(), model.parameters())):
        assert_close(p, q, rtol=2e-6, what=f"parameter {index} after training")


def test_float64_after_dtype_conversion():
    model = mlp(7).double()
    gpipe = pipelined(mlp(7), [3, 3], chunks=2).double()
    x = torch.randn(4, 5, dtype=torch.float64)
    assert_close(gpipe(x), model(x), rtol=1e-12)
    assert all(p.dtype == torch.float64 for p in gpipe.parameters())


def test_gpipe_does_not_copy_the_layers():
    model = mlp(8)
    layers = list(model)
    gpipe = pipetrain.GPipe(model, [2, 4], chunks=2)
    assert [id(layer) for layer in gpipe] == [id(layer) for layer in layers]


def test_deepcopy_of_a_gpipe_trains_independently():
    model = mlp(9)
    gpipe = pipelined(model, [3, 3], chunks=2)
    gpipe(torch.randn(4, 5)).sum().backward()
    twin = copy.deepcopy(gpipe)
    twin.zero_grad()
    gpipe.zero_grad()
    x = torch.randn(4, 5)
    twin(x).sum().backward()
    model(x).sum().backward()
    assert_grads_close(twin.parameters(), model.parameters())
    assert all(p.grad is None for p in gpipe.parameters())


def test_unfused_weight_gradients_give_the_same_result() -> None:
    """``fuse_weight_gradients=False`` leaves every weight gradient to autograd."""
    import copy

    import torch
    from torch import nn

    import pipetrain

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    x = torch.randn(8, 6)
    grads = []
    for fuse in (True, False):
        pipe = pipetrain.GPipe(copy.deepcopy(model), [3, 2], chunks=4, fuse_weight_gradients=fuse)
        pipe(x).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in pipe.parameters()])
    model(x).pow(2).sum().backward()
    for fused, unfused, plain in zip(*grads, (p.grad for p in model.parameters())):
        assert torch.allclose(fused, plain, atol=1e-6) and torch.allclose(unfused, plain, atol=1e-6)



@pytest.mark.parametrize("checkpoint", MODES)
def test_a_partition_that_changes_its_input_in_place_is_named(checkpoint) -> None:
    """An in-place first layer after a cut (autograd forbids changing a received tensor)
    gets an error that names the stage and the fix, in every checkpoint mode."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.ReLU(inplace=True),
                                torch.nn.Linear(5, 3))
    gpipe = pipelined(model, [1, 2], chunks=2, checkpoint=checkpoint)
    with pytest.raises(RuntimeError, match=r"stage 1 changes the stage's input in place.*"
                                           r"inplace=False"):
        gpipe(leaf(torch.randn(6, 5))).sum().backward()
