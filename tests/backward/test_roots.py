"""Backward roots: a stage's backward starts from seeds, keeping its outputs' graph but
not their data, with no explicit-gradient autograd call."""

import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from torch import nn

from pipetrain.backward import Seed, backward_root, fused_backward, start_points
from pipetrain.runtime.stage import StageCompute


def test_a_seed_gives_the_gradient_an_explicit_backward_gives():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    x = torch.randn(5, 3, requires_grad=True)
    g = torch.randn(5, 4)
    (expected,) = torch.autograd.grad(layer(x), x, g)
    root = backward_root(layer(x))
    (got,) = torch.autograd.grad(start_points([root], [g]), x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_seed_keeps_the_graph_but_not_the_outputs_data():
    x = torch.randn(4, 4, requires_grad=True)
    out = torch.nn.functional.gelu(x)  # GELU keeps its input, not its output
    gone = weakref.ref(out)
    root = backward_root(out)
    del out
    assert gone() is None
    (grad,) = torch.autograd.grad(start_points([root], [torch.ones(4, 4)]), x)
    assert grad.shape == (4, 4)


def test_a_gradient_of_the_wrong_shape_is_refused_by_autograd():
    x = torch.randn(4, 4, requires_grad=True)
    root = backward_root(x * 2)
    with pytest.raises(RuntimeError, match=r"got \[2, 4\] but expected shape compatible with \[4, 4\]"):
        torch.autograd.backward(start_points([root], [torch.ones(2, 4)]))


def test_start_points_leave_out_what_needs_no_gradient():
    x = torch.randn(2, requires_grad=True)
    loss, fed = (x * 3).sum(), Seed(x * 2)
    starts = start_points([loss, fed, backward_root(x * 4), torch.ones(2)],
                          [None, torch.ones(2), None, None])
    assert len(starts) == 2 and starts[0] is loss and starts[1] is fed.tensor
    with pytest.raises(ValueError, match="requires grad"):
        Seed(torch.ones(2))


def test_a_stage_keeps_no_output_data_between_forward_and_backward():
    torch.manual_seed(0)
    stage = StageCompute(nn.Sequential(nn.Linear(4, 4), nn.GELU()), stage_index=0,
                         device=torch.device("cpu"))
    reference = [p.detach().clone().requires_grad_() for p in stage.module.parameters()]
    x = torch.randn(3, 4, requires_grad=True)
    out, _ = stage.forward(0, x, checkpointed=False)
    gone = weakref.ref(out)
    del out
    assert gone() is None  # only the graph is held, as autograd would hold it
    (grad_x,) = stage.backward(0, [torch.ones(3, 4)])
    expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, *reference))
    grads = torch.autograd.grad(expected, [x, *reference], torch.ones(3, 4))
    torch.testing.assert_close(grad_x, grads[0])
    for p, g in zip(stage.module.parameters(), grads[1:]):
        torch.testing.assert_close(p.grad, g)


def test_fused_backward_leaves_the_inputs_grad_alone_and_matches_autograd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 2))
    x = torch.randn(5, 4, requires_grad=True)
    x.grad = torch.full((5, 4), 7.0)  # the input's own .grad, not ours to touch
    out = model(x)
    (gx,) = fused_backward([out], [torch.ones(5, 2)], [x], list(model.parameters()))
    assert torch.equal(x.grad, torch.full((5, 4), 7.0))
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    y = torch.func.functional_call(model, dict(zip([n for n, _ in model.named_parameters()],
                                                   reference)), (x.detach().requires_grad_(),))
    expected = torch.autograd.grad(y, reference, torch.ones(5, 2))
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g)
    assert gx.shape == x.shape


_SYMPY_PROBE = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    import pipetrain
    if "sympy" in sys.modules:
        print("preloaded")
    else:
        gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)),
                                [2, 1], chunks=2, checkpoint=sys.argv[1])
        gpipe(torch.randn(4, 4)).square().mean().backward()
        print("sympy" in sys.modules)
    """
)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_gpipe_step_imports_no_sympy(checkpoint):
    """torch checks an explicit gradient's shape with its symbolic-shapes module, whose
    first use imports sympy (about 35 MiB resident): the stages' backwards start from
    seeds with implicit gradients instead."""
    out = subprocess.run([sys.executable, "-c", _SYMPY_PROBE, checkpoint], capture_output=True,
                         text=True, timeout=300, check=True).stdout.strip()
    if out == "preloaded":
        pytest.skip("importing torch loads sympy here")
    assert out == "False"
