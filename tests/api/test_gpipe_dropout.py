"""Dropout in a pipeline: per-(stage, micro-batch) random streams make checkpointing
exact (the recomputation repeats the masks) and runs reproducible under
``torch.manual_seed``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain
from helpers.gpipe import assert_close

MODES = ["always", "except_last", "never"]


class MaskRecorder(nn.Module):
    """Dropout that records its mask, per pass kind (forward / recompute)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p)
        self.masks: dict[str, list[torch.Tensor]] = {"forward": [], "recompute": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dropout(x)
        kind = "recompute" if pipetrain.is_recomputing() else "forward"
        self.masks[kind].append((y != 0).detach().clone())
        return y


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), MaskRecorder(), nn.Linear(16, 16), nn.Dropout(0.3),
        nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 4),
    )


def train_pass(gpipe: pipetrain.GPipe, x: torch.Tensor, seed: int):
    torch.manual_seed(seed)
    gpipe.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    out = gpipe(x)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in gpipe.parameters()]


def test_checkpoint_modes_give_identical_gradients_with_dropout():
    gpipe = pipetrain.GPipe(model(), [2, 2, 3], chunks=4)
    x = torch.randn(8, 6)
    results = {}
    for mode in MODES:
        gpipe.checkpoint = mode
        results[mode] = train_pass(gpipe, x, seed=11)
    out, x_grad, grads = results["never"]
    assert not all(mask.all() for mask in gpipe[1].masks["forward"])  # dropout dropped
    for mode in ("always", "except_last"):
        other_out, other_x_grad, other_grads = results[mode]
        assert torch.equal(other_out, out), mode
        assert torch.equal(other_x_grad, x_grad), mode
        for a, b in zip(other_grads, grads):
            assert torch.equal(a, b), mode


def test_recomputation_repeats_the_forward_masks():
    gpipe = pipetrain.GPipe(model(), [2, 2, 3], chunks=4, checkpoint="always")
    recorder = gpipe[1]
    x = torch.randn(8, 6)
    train_pass(gpipe, x, seed=3)
    forward, recompute = recorder.masks["forward"], recorder.masks["recompute"]
    assert len(forward) == 4 and len(recompute) == 4  # every micro-batch recomputed
    # the recomputation of micro-batch i repeats the mask of its forward
    by_shape = sorted(forward, key=lambda m: m.flatten().tolist())
    assert [m.tolist() for m in by_shape] == [
        m.tolist() for m in sorted(recompute, key=lambda m: m.flatten().tolist())
    ]
    assert not all(torch.equal(forward[0], m) for m in forward[1:])  # masks differ per micro-batch


def test_same_seed_reproduces_a_run_on_the_same_gpipe_and_another_seed_does_not():
    gpipe = pipetrain.GPipe(model(), [3, 4], chunks=2, checkpoint="except_last")
    x = torch.randn(6, 6)
    first = train_pass(gpipe, x, seed=5)
    again = train_pass(gpipe, x, seed=5)
    other = train_pass(gpipe, x, seed=6)
    assert torch.equal(first[0], again[0])
    assert all(torch.equal(a, b) for a, b in zip(first[2], again[2]))
    assert not torch.equal(first[0], other[0])


def test_eval_mode_draws_no_masks():
    gpipe = pipetrain.GPipe(model(), [3, 4], chunks=2).eval()
    x = torch.randn(6, 6)
    plain = nn.Sequential(*gpipe).eval()
    with torch.no_grad():
        expected = plain(x)
        assert torch.allclose(gpipe(x), expected, atol=1e-6)
    assert torch.allclose(gpipe(x), expected, atol=1e-6)  # with grad enabled too


def test_training_no_grad_forwards_draw_new_masks_each_call():
    gpipe = pipetrain.GPipe(model(), [3, 4], chunks=2)
    x = torch.randn(6, 6)
    with torch.no_grad():
        a, b = gpipe(x), gpipe(x)
        torch.manual_seed(1)
        c = gpipe(x)
        torch.manual_seed(1)
        d = gpipe(x)
    assert not torch.equal(a, b)
    assert torch.equal(c, d)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_several_forwards_before_one_backward_with_dropout(mode):
    """The recomputation of the first forward runs after the second forward."""
    gpipe = pipetrain.GPipe(model(), [2, 5], chunks=2, checkpoint=mode)
    x1, x2 = torch.randn(4, 6), torch.randn(4, 6)
    torch.manual_seed(9)
    gpipe.zero_grad()
    (gpipe(x1).sum() + gpipe(x2).pow(2).sum()).backward()
    grads = [p.grad.clone() for p in gpipe.parameters()]
    # reference: the same two forwards, each with its own backward (no interleaving)
    torch.manual_seed(9)
    gpipe.checkpoint = "never"
    gpipe.zero_grad()
    out1 = gpipe(x1)
    out2 = gpipe(x2)
    out1.sum().backward()
    out2.pow(2).sum().backward()
    # equal up to the order in which the two backward passes accumulate
    for a, b in zip(grads, gpipe.parameters()):
        assert_close(a, b.grad)


class FunctionalDropout(nn.Module):
    """A random layer of no known type: ``F.dropout`` with its own rate attribute."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, x):
        return nn.functional.dropout(x, self.rate, self.training)


class Noise(nn.Module):
    """Adds Gaussian noise in training: draws with torch.randn_like."""

    def forward(self, x):
        return x + torch.randn_like(x) if self.training else x


@pytest.mark.parametrize("layer", [FunctionalDropout(0.5), Noise()], ids=["F.dropout", "noise"])
def test_random_layers_of_unknown_types_are_recomputed_exactly(layer):
    torch.manual_seed(0)
    gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(6, 8), layer, nn.Linear(8, 3)), [2, 1],
                            chunks=3)
    x = torch.randn(6, 6)
    for step in range(3):  # during and after the first calls, when stages are watched
        results = {}
        for mode in ("always", "never"):
            gpipe.checkpoint = mode
            results[mode] = train_pass(gpipe, x, seed=step)
        for a, b in zip(results["always"][2], results["never"][2]):
            assert torch.equal(a, b), step
    another = train_pass(gpipe, x, seed=99)
    assert not torch.equal(another[0], results["never"][0])  # the layer is random


def test_a_deterministic_model_leaves_the_caller_generator_alone():
    torch.manual_seed(0)
    gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)),
                            [2, 1], chunks=2)
    x = torch.randn(4, 4)
    for _ in range(3):  # the watched calls and the free ones
        state = torch.get_rng_state()
        gpipe(x).sum().backward()
        with torch.no_grad():
            gpipe(x)
        assert torch.equal(torch.get_rng_state(), state)


def test_a_random_model_moves_the_caller_generator_on():
    gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(4, 4), FunctionalDropout(0.5)), [1, 1],
                            chunks=2)
    for _ in range(3):
        state = torch.get_rng_state()
        gpipe(torch.ones(4, 4)).sum().backward()
        assert not torch.equal(torch.get_rng_state(), state)


def test_a_dropout_switched_on_after_the_watched_calls_is_seeded():
    torch.manual_seed(0)
    gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.0), nn.Linear(8, 3)),
                            [2, 1], chunks=3)
    x = torch.randn(6, 6)
    for step in range(3):  # p = 0 draws nothing: the stage is watched, then runs freely
        train_pass(gpipe, x, seed=step)
    gpipe[1].p = 0.5
    results = {}
    for mode in ("always", "never"):
        gpipe.checkpoint = mode
        results[mode] = train_pass(gpipe, x, seed=7)
    assert not results["never"][0].eq(train_pass(gpipe, x, seed=8)[0]).all()
    for a, b in zip(results["always"][2], results["never"][2]):
        assert torch.equal(a, b)
