"""Beyond torchgpipe: nested and non-tensor values between partitions, several forwards
before one backward, forwards without autograd, layers whose output needs no gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipetrain
from helpers.gpipe import assert_close, assert_grads_close, leaf, mlp


class Encode(nn.Module):
    """dict in -> tuple of (float features, int ids, a string, an int) out."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)

    def forward(self, batch):
        features = self.linear(batch["x"]) * batch["scale"]
        return features, batch["ids"], batch["tag"], batch["offset"]


class Mix(nn.Module):
    """Uses every piece it receives, passes the non-tensors on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)

    def forward(self, values):
        features, ids, tag, offset = values
        assert isinstance(tag, str) and isinstance(offset, int)
        mixed = torch.tanh(features + self.embed(ids) + offset)
        return {"h": mixed, "ids": ids + 1, "tag": tag.upper(), "n": offset}


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, values):
        return {"out": self.linear(values["h"]), "ids": values["ids"], "tag": values["tag"],
                "pair": (values["h"].sum(dim=1), values["n"])}


def nested_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Encode(), Mix(), Head())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_nested_and_non_tensor_values_between_partitions(checkpoint):
    model = nested_model()
    gpipe = pipetrain.GPipe(copy.deepcopy(model), [1, 1, 1], chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, 4)
    scale = torch.tensor(1.5)  # 0-dim: shared by every micro-batch
    ids = torch.randint(0, 9, (7,))

    def batch(x, scale):
        return {"x": x, "ids": ids, "tag": "abc", "offset": 2, "scale": scale}

    x_ref, s_ref, x_pipe, s_pipe = leaf(x), leaf(scale), leaf(x), leaf(scale)
    expected = model(batch(x_ref, s_ref))
    actual = gpipe(batch(x_pipe, s_pipe))
    assert actual["tag"] == "ABC" and actual["pair"][1] == 2
    assert torch.equal(actual["ids"], expected["ids"]) and actual["ids"].dtype == torch.int64
    assert not actual["ids"].requires_grad
    assert_close(actual["out"], expected["out"])
    assert_close(actual["pair"][0], expected["pair"][0])
    for out in (expected, actual):
        (out["out"].pow(2).sum() + out["pair"][0].sum()).backward()
    assert_close(x_pipe.grad, x_ref.grad, what="x grad")
    assert_close(s_pipe.grad, s_ref.grad, what="0-dim input grad (summed over micro-batches)")
    assert_grads_close(gpipe.parameters(), model.parameters())


def test_a_string_passed_between_partitions_reaches_the_output():
    class Tag(nn.Module):
        def forward(self, x):
            return x, "tagged"

    class Check(nn.Module):
        def forward(self, pair):
            x, text = pair
            return x * len(text), text

    gpipe = pipetrain.GPipe(nn.Sequential(Tag(), Check()), [1, 1], chunks=2)
    out, text = gpipe(torch.ones(4, 2, requires_grad=True))
    assert text == "tagged" and torch.equal(out, torch.full((4, 2), 6.0))


def test_several_forwards_before_one_backward():
    model = mlp(1)
    gpipe = pipetrain.GPipe(copy.deepcopy(model), [2, 4], chunks=2, checkpoint="except_last")
    a, b = torch.randn(4, 5), torch.randn(6, 5)
    a_ref, b_ref, a_pipe, b_pipe = leaf(a), leaf(b), leaf(a), leaf(b)
    (model(a_ref).sum() + model(b_ref).pow(2).sum()).backward()
    (gpipe(a_pipe).sum() + gpipe(b_pipe).pow(2).sum()).backward()
    assert_close(a_pipe.grad, a_ref.grad)
    assert_close(b_pipe.grad, b_ref.grad)
    assert_grads_close(gpipe.parameters(), model.parameters())


def test_an_unused_forward_frees_its_micro_batches():
    gpipe = pipetrain.GPipe(mlp(2), [3, 3], chunks=2, checkpoint="never")
    stages = [s for e in gpipe._pipeline().executors for s in e.stages.values()]
    out = gpipe(torch.randn(4, 5))
    assert all(stage.in_flight == 2 for stage in stages)
    del out
    assert all(stage.in_flight == 0 for stage in stages)
    gpipe(torch.randn(4, 5)).sum().backward()  # still works
    assert all(stage.in_flight == 0 for stage in stages)


def test_no_grad_forward_keeps_nothing_and_matches_plain():
    model = mlp(3)
    gpipe = pipetrain.GPipe(copy.deepcopy(model), [2, 2, 2], chunks=4)
    x = torch.randn(8, 5, requires_grad=True)
    with torch.no_grad():
        out = gpipe(x)
        assert_close(out, model(x))
    assert not out.requires_grad
    stages = [s for e in gpipe._pipeline().executors for s in e.stages.values()]
    assert all(stage.in_flight == 0 for stage in stages)


def test_eval_mode_with_grad_matches_plain_and_backpropagates():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model(torch.randn(16, 5))  # running statistics to use in eval
    model.eval()
    gpipe = pipetrain.GPipe(copy.deepcopy(model), [2, 2], chunks=2).eval()
    assert not gpipe.training and not any(m.training for m in gpipe.modules())
    x = torch.randn(6, 5)
    x_ref, x_pipe = leaf(x), leaf(x)
    model(x_ref).sum().backward()
    gpipe(x_pipe).sum().backward()
    assert_close(x_pipe.grad, x_ref.grad)
    assert_grads_close(gpipe.parameters(), model.parameters())


class Detach(nn.Module):
    def forward(self, x):
        return x.detach()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_layers_whose_output_needs_no_gradient(checkpoint):
    torch.manual_seed(5)
    # partition 0 has no parameters and gets an input without grad; a middle layer
    # stops the gradient, so the layers before it get none
    model = nn.Sequential(nn.ReLU(), nn.Linear(4, 4), Detach(), nn.Linear(4, 4), nn.Tanh())
    gpipe = pipetrain.GPipe(copy.deepcopy(model), [1, 2, 2], chunks=3, checkpoint=checkpoint)
    x = torch.randn(6, 4)
    model(x).sum().backward()
    gpipe(x).sum().backward()
    assert gpipe[1].weight.grad is None and model[1].weight.grad is None
    assert_grads_close(gpipe.parameters(), model.parameters())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_an_output_that_needs_no_gradient_next_to_one_that_does(checkpoint):
    class Split(nn.Module):
        def forward(self, x):
            return x, x.detach() * 2, x.argmax(dim=1)

    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Split())
    gpipe = pipetrain.GPipe(copy.deepcopy(model), [1, 2], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4)
    expected, actual = model(x), gpipe(x)
    assert torch.equal(actual[2], expected[2])
    (expected[0].sum() + expected[1].sum()).backward()
    (actual[0].sum() + actual[1].sum()).backward()
    assert_grads_close(gpipe.parameters(), model.parameters())


def test_a_frozen_model_in_training_mode_runs_without_autograd():
    model = mlp(7).requires_grad_(False)
    gpipe = pipetrain.GPipe(copy.deepcopy(model), [3, 3], chunks=2)
    x = torch.randn(4, 5)
    out = gpipe(x)
    assert not out.requires_grad
    assert_close(out, model(x))
