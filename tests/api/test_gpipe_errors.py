"""GPipe's errors: each names the bad value and shows a fix; failures inside the
pipeline surface as the original exception, never hang, and leave GPipe usable."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import pipetrain
from helpers.gpipe import assert_close, mlp
from pipetrain.api.gpipe import MovingModuleError
from pipetrain.partition import BalanceError
from pipetrain.skip import pop, skippable, stash


def three() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))


def test_not_a_sequential():
    with pytest.raises(TypeError, match=r"got ModuleList; fix: .*nn\.Sequential\("):
        pipetrain.GPipe(nn.ModuleList([nn.Linear(2, 2)]), [1])


@pytest.mark.parametrize(
    ("balance", "problem"),
    [
        (None, "balance is required (got None)"),
        ([1, 1], "(module: 3, sum of balance: 2); the balance [1, 1] must add up to the module's 3 layers"),
        ([0, 3], "balance[0] = 0"),
        ([4, -1], "balance[1] = -1"),
        ([1, 1, 1, 1], "4 partitions but the module has only 3 layers"),
        ([1.5, 1.5], "balance[0] = 1.5"),
    ],
)
def test_bad_balance(balance, problem):
    with pytest.raises(BalanceError) as info:
        pipetrain.GPipe(three(), balance)
    message = str(info.value)
    assert problem in message
    assert "fix:" in message and "balance_by_time" in message
    assert re.search(r"balance = \[\d+(, \d+)*\]", message)  # a balance that works


def test_the_suggested_balance_works():
    with pytest.raises(BalanceError) as info:
        pipetrain.GPipe(three(), [2, 2])
    suggested = re.search(r"balance = (\[[\d, ]+\])", str(info.value)).group(1)
    pipetrain.GPipe(three(), eval(suggested))


@pytest.mark.parametrize("chunks", [0, -2, 2.5, "4.0", True])
def test_bad_chunks(chunks):
    with pytest.raises(ValueError, match=rf"chunks must be positive integer, got {re.escape(repr(chunks))}; fix: chunks=4"):
        pipetrain.GPipe(three(), [2, 1], chunks=chunks)


def test_unknown_checkpoint_mode():
    with pytest.raises(ValueError, match=r"'always', 'except_last', or 'never': got 'sometimes'; fix: checkpoint='except_last'"):
        pipetrain.GPipe(three(), [2, 1], checkpoint="sometimes")


def test_too_few_devices():
    with pytest.raises(IndexError, match=r"1 devices \(\['cpu'\]\) for 2 partitions; fix: .*devices=\['cpu', 'cpu'\]"):
        pipetrain.GPipe(three(), [2, 1], devices=["cpu"])


def test_duplicate_children():
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"layer '2' is the same module object as layer '0'(.|\n)*fix: .*deepcopy"):
        pipetrain.GPipe(nn.Sequential(layer, nn.ReLU(), layer), [2, 1])


def test_parameters_shared_across_partitions():
    first, last = nn.Linear(2, 2), nn.Linear(2, 2)
    last.weight = first.weight
    with pytest.raises(ValueError, match=r"parameter '2.weight' is shared with '0.weight'(.|\n)*fix:"):
        pipetrain.GPipe(nn.Sequential(first, nn.ReLU(), last), [2, 1])


@skippable(stash=["kept"])
class Keep(nn.Module):
    def forward(self, x):
        yield stash("kept", x)
        return x


@skippable(pop=["other"])
class Take(nn.Module):
    def forward(self, x):
        return x + (yield pop("other"))


def test_unmatched_stash_and_pop():
    with pytest.raises(TypeError) as info:
        pipetrain.GPipe(nn.Sequential(Keep(), nn.ReLU(), Take()), [2, 1])
    message = str(info.value)
    assert ("no module declared 'kept' as poppable but stashed: '0' stashes it and no later "
            "layer pops it") in message
    assert ("'2' declared 'other' as poppable but it was not stashed: no earlier layer "
            "stashes it") in message
    assert "isolate(ns1)" in message  # the fix


@pytest.mark.parametrize(
    ("move", "shown"),
    [
        (lambda g: g.to("cpu"), "GPipe.to('cpu')"),
        (lambda g: g.to(torch.device("cpu")), "GPipe.to(device(type='cpu'))"),
        (lambda g: g.to(device="cpu"), "GPipe.to(device='cpu')"),
        (lambda g: g.to("cpu", torch.float64), "GPipe.to('cpu', torch.float64)"),
        (lambda g: g.to(torch.zeros(1)), "GPipe.to(<tensor on cpu>)"),
        (lambda g: g.to(0), "GPipe.to(0)"),
        (lambda g: g.cuda(), "GPipe.cuda()"),
        (lambda g: g.cuda(1), "GPipe.cuda(1)"),
        (lambda g: g.cpu(), "GPipe.cpu()"),
    ],
)
def test_moving_the_module_is_refused(move, shown):
    gpipe = pipetrain.GPipe(three(), [2, 1])
    with pytest.raises(MovingModuleError) as info:
        move(gpipe)
    message = str(info.value)
    assert message.startswith(shown)
    assert "fix: choose the devices when wrapping the model, GPipe(model, balance, devices=" in message
    assert isinstance(info.value, TypeError)  # as torchgpipe's
    assert all(p.dtype == torch.float32 for p in gpipe.parameters())


def test_dtype_conversion_still_works():
    model = three()
    gpipe = pipetrain.GPipe(copy.deepcopy(model), [2, 1], chunks=2)
    assert gpipe.to(torch.float64) is gpipe
    assert all(p.dtype == torch.float64 for p in gpipe.parameters())
    x = torch.randn(4, 2, dtype=torch.float64)
    assert_close(gpipe(x), model.double()(x), rtol=1e-12)
    gpipe.float()
    assert gpipe.to(dtype=torch.float32) is gpipe and gpipe(x.float()).dtype == torch.float32
    gpipe.half()
    assert all(p.dtype == torch.float16 for p in gpipe.parameters())


def test_backward_twice_is_a_clear_error():
    gpipe = pipetrain.GPipe(mlp(0), [3, 3], chunks=2)
    out = gpipe(torch.randn(4, 5))
    loss = out.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"backward through a GPipe output twice(.|\n)*fix: run the forward again"):
        loss.backward()
    # a new graph over the same output: still refused
    with pytest.raises(RuntimeError, match="twice"):
        out.sum().backward()
    gpipe(torch.randn(4, 5)).sum().backward()  # a new forward works


class Fail(nn.Module):
    """Raises in forward (or in backward) on the chosen micro-batch when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)
        self.where: str | None = None
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.where == "forward" and self.calls == 2:
            raise ZeroDivisionError("layer failed on purpose")
        y = self.linear(x)
        if self.where == "backward" and y.requires_grad:
            def hook(grad):
                raise ZeroDivisionError("layer backward failed on purpose")
            y.register_hook(hook)
        return y


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failing_layer_surfaces_its_exception_and_the_next_step_works(where, checkpoint):
    model = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), Fail(), nn.Tanh(), nn.Linear(5, 5))
    reference = copy.deepcopy(model)
    gpipe = pipetrain.GPipe(model, [2, 1, 2], chunks=4, checkpoint=checkpoint)
    gpipe[2].where = where
    x = torch.randn(8, 5)
    with pytest.raises(ZeroDivisionError, match="on purpose") as info:
        gpipe(x).sum().backward()
    notes = getattr(info.value, "__notes__", [])
    # one note, naming the stage (rank 1 here) and the action that raised
    assert len(notes) == 1, notes
    action = "1F1" if where == "forward" else "1B"
    assert notes[0].startswith(f"pipetrain: raised by rank 1 running action {action}"), notes
    # the next step works and gives the plain gradients
    gpipe[2].where = None
    gpipe.zero_grad()
    gpipe(x).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        assert_close(p.grad, q.grad)
    stages = [s for e in gpipe._pipeline().executors for s in e.stages.values()]
    assert all(stage.in_flight == 0 for stage in stages)


@pytest.mark.timeout(60)
def test_a_failing_layer_without_grad():
    model = nn.Sequential(nn.Linear(5, 5), Fail(), nn.Linear(5, 5))
    gpipe = pipetrain.GPipe(model, [1, 1, 1], chunks=3)
    gpipe[1].where = "forward"
    with torch.no_grad(), pytest.raises(ZeroDivisionError):
        gpipe(torch.randn(6, 5))
    gpipe[1].where = None
    with torch.no_grad():
        assert gpipe(torch.randn(6, 5)).shape == (6, 5)
