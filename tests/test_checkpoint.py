"""Tests for pipetrain.checkpoint: non-reentrant re-materialization and its flags."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from pipetrain.checkpoint import (
    CHECKPOINT_MODES,
    checkpoint,
    checkpoint_stop,
    is_checkpointing,
    is_recomputing,
)


class Recorder(nn.Module):
    """Records (thread name, is_checkpointing, is_recomputing) on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((threading.current_thread().name, is_checkpointing(), is_recomputing()))
        return x


def dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 6),
                         nn.Dropout(0.3))


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_gradients_match_plain_run_with_dropout():
    model = dropout_model()
    x = torch.randn(8, 6, requires_grad=True)

    torch.manual_seed(123)
    plain = model(x)
    plain.square().sum().backward()
    x_grad, param_grads = x.grad.clone(), grads(model)
    after_plain = torch.rand(1)

    model.zero_grad()
    x.grad = None
    torch.manual_seed(123)
    out = checkpoint(model, x)
    assert torch.equal(out, plain)
    out.square().sum().backward()
    after_checkpoint = torch.rand(1)

    # Same masks in the recomputation -> identical gradients; the global random
    # state after backward is as if nothing had been recomputed.
    assert torch.allclose(x.grad, x_grad)
    assert all(torch.allclose(a, b) for a, b in zip(grads(model), param_grads))
    assert torch.equal(after_checkpoint, after_plain)
    # Dropout really dropped something, so a different mask would have shown.
    assert (x_grad == 0).any() or (param_grads[0] == 0).any()


def test_flags_inside_both_passes_and_false_outside():
    recorder = Recorder()
    x = torch.randn(3, requires_grad=True)
    out = checkpoint(lambda t: recorder(t * 2) * t, x)
    assert recorder.calls == [("MainThread", True, False)]
    assert not is_checkpointing() and not is_recomputing()
    out.sum().backward()
    assert recorder.calls[1] == ("MainThread", False, True)
    assert not is_checkpointing() and not is_recomputing()


def test_flags_in_worker_threads_and_backward_in_another_thread():
    recorder = Recorder()
    x = torch.randn(4, requires_grad=True)
    inside = threading.Event()
    release = threading.Event()
    outputs = []
    seen_from_main = []

    def stage(t: torch.Tensor) -> torch.Tensor:
        y = recorder(t).exp()  # the recomputation stops after the last saved tensor
        inside.set()
        release.wait(timeout=10)
        return y

    def forward_worker() -> None:
        outputs.append(checkpoint(stage, x))

    worker = threading.Thread(target=forward_worker, name="stage0")
    worker.start()
    assert inside.wait(timeout=10)
    seen_from_main.append((is_checkpointing(), is_recomputing()))  # other thread: not set
    release.set()
    worker.join(timeout=10)

    backward = threading.Thread(target=lambda: outputs[0].sum().backward(), name="autograd")
    backward.start()
    backward.join(timeout=10)

    assert seen_from_main == [(False, False)]
    assert recorder.calls == [("stage0", True, False), ("autograd", False, True)]
    assert torch.allclose(x.grad, x.exp())


def test_nested_inputs_outputs_and_non_tensor_values():
    model = dropout_model()

    def function(inputs: dict, pair: tuple, scale: float, tag: str):
        assert tag == "keep"
        hidden = model(inputs["x"]) * scale + pair[0]
        return {"out": hidden, "extra": (pair[1] * 2, tag)}

    def run(wrap):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
        b = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), requires_grad=True)
        c = torch.ones(2, requires_grad=True)
        model.zero_grad()
        torch.manual_seed(7)
        result = wrap(function, {"x": x, "unused": None}, (b, c), 3.0, "keep")
        assert result["extra"][1] == "keep"
        (result["out"].sum() + result["extra"][0].sum()).backward()
        return x.grad, b.grad, c.grad, grads(model)

    reference = run(lambda f, *args: f(*args))
    checkpointed = run(checkpoint)
    for a, b in zip(reference[:3], checkpointed[:3]):
        assert torch.allclose(a, b)
    assert all(torch.allclose(a, b) for a, b in zip(reference[3], checkpointed[3]))


def test_parameters_get_gradients_when_no_input_requires_grad():
    # The reentrant variant would leave the parameters without gradients here.
    layer = nn.Linear(3, 3)
    checkpoint(layer, torch.randn(2, 3)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_input_gradients_then_weight_gradients_as_zero_bubble_does():
    model = dropout_model()
    recorder = Recorder()
    x = torch.randn(5, 6, requires_grad=True)

    torch.manual_seed(5)
    model(x).sum().backward()
    x_ref, params_ref = x.grad.clone(), grads(model)
    model.zero_grad()
    x.grad = None

    torch.manual_seed(5)
    out = checkpoint(lambda t: model(recorder(t)), x).sum()
    (x_grad,) = torch.autograd.grad(out, inputs=[x], retain_graph=True)
    assert all(p.grad is None for p in model.parameters())  # only the input gradient
    params = list(model.parameters())
    torch.autograd.backward(out, inputs=params)

    assert torch.allclose(x_grad, x_ref)
    assert x.grad is None
    assert all(torch.allclose(p.grad, g) for p, g in zip(params, params_ref))
    # Each of the two passes recomputed, with the same masks.
    assert [c[1:] for c in recorder.calls] == [(True, False), (False, True), (False, True)]


def test_no_grad_runs_plainly_without_flags():
    recorder = Recorder()
    with torch.no_grad():
        out = checkpoint(recorder, torch.ones(2))
    assert out.tolist() == [1.0, 1.0]
    assert recorder.calls == [("MainThread", False, False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dropout_masks_are_preserved():
    model = dropout_model().cuda()
    x = torch.randn(8, 6, device="cuda", requires_grad=True)
    torch.manual_seed(3)
    model(x).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    torch.manual_seed(3)
    checkpoint(lambda inputs: model(inputs["x"]), {"x": x}).sum().backward()
    assert torch.allclose(x.grad, ref)


@pytest.mark.parametrize(
    ("mode", "training", "expected"),
    [("always", True, 4), ("except_last", True, 3), ("never", True, 0),
     ("always", False, 0), ("except_last", False, 0)],
)
def test_checkpoint_stop(mode, training, expected):
    assert checkpoint_stop(mode, 4, training=training) == expected


def test_checkpoint_stop_edge_cases_and_errors():
    assert CHECKPOINT_MODES == ("always", "except_last", "never")
    assert checkpoint_stop("except_last", 1) == 0
    assert checkpoint_stop("except_last", 0) == 0
    with pytest.raises(ValueError, match=r"one of 'always', 'except_last', 'never', got 'sometimes'"):
        checkpoint_stop("sometimes", 4)
    with pytest.raises(ValueError, match=r"num_microbatches must be >= 0, got -1"):
        checkpoint_stop("always", -1)
