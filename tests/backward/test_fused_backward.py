"""The fused backward (one pass, linear layers' weight gradients accumulated in place) and
the split backward give autograd's gradients, for the layers pipetrain's users train."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from pipetrain.backward import GradientPool, backward_input, fused_backward
from pipetrain.backward.split import FUSE_MIN_ELEMENTS, _linears, _walk
from pipetrain.models import GPTConfig, gpt_layer_factories, gpt_loss

TOL = {"rtol": 1e-5, "atol": 1e-6}
CONFIG = GPTConfig(num_layers=2, width=32, num_heads=4, context=16, tie_embeddings=False)
MICROBATCHES = 3


class Conv1D(nn.Module):
    """Hugging Face GPT-2's projection: ``addmm(bias, x, W)`` with ``W`` of shape (in, out)."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.weight.size(1))
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(shape)


class TwiceUsed(nn.Module):
    """One linear layer applied twice: its weight feeds two nodes (not fusible)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


def _gpt(first: int, last: int) -> nn.Module:
    factories = gpt_layer_factories(CONFIG, seed=0)
    return nn.Sequential(*(factories[i]() for i in range(first, last)))


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, CONFIG.context),
                         generator=torch.Generator().manual_seed(seed))


def _hidden(seed: int, width: int = CONFIG.width) -> torch.Tensor:
    return torch.randn(2, CONFIG.context, width, generator=torch.Generator().manual_seed(seed))


# name -> (module, input of micro-batch k, loss target of micro-batch k or None, fusible)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor],
                       Callable[[int], torch.Tensor] | None, int]] = {
    # embedding + block: an int64 input that needs no gradient
    "gpt first stage": (lambda: _gpt(0, 2), _tokens, None, 4),
    # block + head + loss: the head's bias-free linear on a 3-D input is an mm
    "gpt last stage": (lambda: _gpt(2, 4), _hidden, _tokens, 5),
    "conv1d (x @ W)": (lambda: nn.Sequential(Conv1D(32, 48), nn.GELU(), Conv1D(48, 32)),
                       _hidden, None, 2),
    "a weight used twice": (TwiceUsed, lambda k: _hidden(k, 8), None, 1),
    # only linear layers, small gradients: taken from the pass's result, no hooks; the
    # input needs no gradient (a first stage), so the first layer's node never runs
    "mlp first stage": (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
                        lambda k: _hidden(k, 8).requires_grad_(False).long().float(), None, 2),
}
NO_INPUT_GRAD = {"mlp first stage"}


def _run(case: str, backward: str, *, pool: GradientPool | None = None,
         module: nn.Module | None = None) -> tuple[nn.Module, list[torch.Tensor | None]]:
    """``MICROBATCHES`` micro-batches' backwards accumulated; the modules' gradients and
    the input gradients, by ``backward`` = autograd / fused / split."""
    build, make_input, make_target, _ = CASES[case]
    if module is None:
        torch.manual_seed(0)
        module = build()
    params = list(module.parameters())
    input_grads: list[torch.Tensor | None] = []
    for k in range(MICROBATCHES):
        x = make_input(k)
        if x.is_floating_point() and case not in NO_INPUT_GRAD:
            x.requires_grad_(True)
        out = module(x)
        if make_target is not None:
            outputs, grads = [gpt_loss(out, make_target(k))], [None]
        else:
            outputs, grads = [out], [torch.randn(out.shape, generator=torch.Generator().manual_seed(k))]
        if backward == "autograd":
            torch.autograd.backward(outputs, [g for g in grads if g is not None] or None)
            input_grads.append(x.grad)
        elif backward == "fused":
            input_grads.extend(fused_backward(outputs, grads, [x], params, pool=pool,
                                              min_elements=0))
        else:
            found, weight = backward_input(outputs, grads, [x], params, pool=pool)
            weight.run()
            input_grads.extend(found)
    return module, input_grads


@pytest.mark.parametrize("backward", ["fused", "split"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_equal_autograd(case: str, backward: str) -> None:
    reference, reference_inputs = _run(case, "autograd")
    ours, our_inputs = _run(case, backward)
    for (name, p), q in zip(reference.named_parameters(), ours.parameters()):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    for theirs, mine in zip(reference_inputs, our_inputs):
        if theirs is None:
            assert mine is None
        else:
            torch.testing.assert_close(mine, theirs, **TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_the_fusible_layers_are_found(case: str) -> None:
    build, make_input, _, fusible = CASES[case]
    module = build()
    x = make_input(0)
    out = module(x.requires_grad_(True) if x.is_floating_point() else x)
    order, consumers = _walk([out.grad_fn])
    assert len(_linears(order, consumers, module.parameters())) == fusible


@pytest.mark.parametrize("case", ["gpt last stage", "mlp"])
def test_fused_layers_write_into_the_kept_buffers_and_leave_input_grads_alone(case: str) -> None:
    """The pool's buffers become ``.grad`` (autograd never writes into them): the fused
    path (hooks inside the pass for the GPT, the pass's result for the MLP), not autograd,
    accumulated the weights; an input's own ``.grad`` is kept."""
    if case == "mlp":
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        width, loss_fn = 32, lambda out, k: out.square().mean()
    else:
        module, _ = _run("gpt last stage", "fused")
        width, loss_fn = CONFIG.width, lambda out, k: gpt_loss(out, _tokens(k))
        module.zero_grad()
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    pool = GradientPool()
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    for m in linears:  # as if an earlier step had fused them
        pool.lend(m.weight, m.weight.grad)
    pool.release(module.parameters())
    kept = {id(m.weight): pool.take(m.weight) for m in linears}
    for m in linears:  # put them back: take() hands a buffer out once
        m.weight.grad = kept[id(m.weight)]
        pool.lend(m.weight, m.weight.grad)
    pool.release(module.parameters())
    x = _hidden(7, width).requires_grad_(True)
    before = torch.full_like(x, 3.0)
    x.grad = before
    (gx,) = fused_backward([loss_fn(module(x), 7)], [None], [x],
                           list(module.parameters()), pool=pool, min_elements=0)
    assert gx is not None and gx is not before
    assert x.grad is before and bool((before == 3.0).all())
    for m in linears:
        assert m.weight.grad is kept[id(m.weight)]


def test_autocast_fuses_nothing_and_equals_autograd() -> None:
    torch.manual_seed(0)
    module = _gpt(2, 4)
    copy_ = copy.deepcopy(module)
    x, target = _hidden(1).requires_grad_(True), _tokens(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = gpt_loss(module(x), target)
        order, consumers = _walk([loss.grad_fn])
        assert _linears(order, consumers, module.parameters()) == {}
        reference = gpt_loss(copy_(x.detach().clone().requires_grad_(True)), target)
    fused_backward([loss], [None], [x], list(module.parameters()))
    reference.backward()
    for p, q in zip(copy_.parameters(), module.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_a_weight_with_a_hook_is_left_to_autograd() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    seen: list[torch.Tensor] = []
    lin.weight.register_hook(lambda g: seen.append(g) or None)
    x = torch.randn(3, 4, requires_grad=True)
    out = lin(x)
    order, consumers = _walk([out.grad_fn])
    assert _linears(order, consumers, lin.parameters()) == {}
    fused_backward([out], [torch.ones(3, 4)], [x], list(lin.parameters()), min_elements=0)
    assert len(seen) == 1 and lin.weight.grad is not None


def test_small_weights_are_left_to_autograd_by_default() -> None:
    """Below FUSE_MIN_ELEMENTS the fused path is autograd's: a kept buffer is not
    written (autograd makes its own gradient), and the gradients are the same."""
    torch.manual_seed(0)
    small, large = nn.Linear(64, 64), nn.Linear(512, 512)
    assert small.weight.numel() < FUSE_MIN_ELEMENTS <= large.weight.numel()
    for lin in (small, large):
        reference = copy.deepcopy(lin)
        pool = GradientPool()
        lin.weight.grad = torch.zeros_like(lin.weight)
        buffer = lin.weight.grad
        pool.lend(lin.weight, buffer)  # as if an earlier step had fused it
        pool.release([lin.weight])
        x = torch.randn(4, lin.in_features, requires_grad=True)
        fused_backward([lin(x)], [torch.ones(4, lin.out_features)], [x], list(lin.parameters()),
                       pool=pool)
        reference(x.detach()).backward(torch.ones(4, lin.out_features))
        assert (lin.weight.grad is buffer) == (lin is large)
        torch.testing.assert_close(lin.weight.grad, reference.weight.grad, **TOL)
