"""pipetrain.compat: the supported torch releases, and the gate on the private torch names
the fused backward reads. Run on every supported torch the suite is run on (``.ci/run``:
the pinned one; ``.ci/oldest-torch``: the oldest): each test fails if the installed torch
no longer behaves as the fused path expects, instead of the path silently turning off."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pipetrain import compat
from pipetrain.backward import GradientPool, fused_backward
from pipetrain.backward.split import _linears, _walk

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_declares_the_supported_range() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', text)
    assert found is not None, "pyproject.toml's torch requirement is not '>=A.B,<C.D'"
    low, high = (int(found[1]), int(found[2])), (int(found[3]), int(found[4]))
    assert low == compat.OLDEST_TORCH
    assert high == (compat.NEWEST_TORCH[0], compat.NEWEST_TORCH[1] + 1)


def test_the_installed_torch_is_a_supported_one() -> None:
    assert compat.OLDEST_TORCH <= compat.torch_version() <= compat.NEWEST_TORCH, torch.__version__


def test_torch_versions_are_read_as_major_and_minor() -> None:
    assert compat.torch_version("2.11.0+cu130") == (2, 11)
    assert compat.torch_version("2.9.1") == (2, 9)
    assert compat.torch_version("2.16.0a0+git1234abc") == (2, 16)
    with pytest.raises(ValueError, match="'nightly'"):
        compat.torch_version("nightly")


def test_the_fused_path_is_open_on_this_torch() -> None:
    """Every private name the gate guards behaves as expected here (the probe names the
    first one that does not)."""
    assert compat._probe() is None
    assert compat.fused_gemm_supported()


def test_the_probe_draws_nothing_from_torchs_generator() -> None:
    """The gate is decided during a run's first split backward: a draw there would shift the
    run's dropout masks from single-process training's."""
    before = torch.default_generator.get_state()
    assert compat._probe() is None
    assert torch.equal(before, torch.default_generator.get_state())


def test_the_probe_leaves_the_process_no_larger() -> None:
    """The gate is decided inside a run's first backward, on the CPU while the step's
    activations are held: what the probe loads stays resident for the whole run and counts
    in its peak. A probe that built its layer on the meta device loaded torch's Python meta
    kernels there (33 MiB here, 11% of a 16-layer MLP's peak). Fresh process: the gate is
    decided once per process."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from helpers.memory import anonymous_bytes\n"
        "from pipetrain import compat\n"
        "before = anonymous_bytes()\n"
        "assert compat.fused_gemm_supported()\n"
        "print(anonymous_bytes() - before)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    grown_mib = int(done.stdout.split()[-1]) / 2**20
    assert grown_mib < 4.0, f"deciding the fused gate grew the process by {grown_mib:.1f} MiB"


def test_a_linear_layer_reads_as_a_gemm_of_its_input() -> None:
    lin = nn.Linear(3, 5)
    x = torch.randn(2, 4, 3, requires_grad=True)  # 3-D: flattened into one addmm
    out = lin(x)
    nodes, _ = _walk([out.grad_fn])
    gemms = [(node, compat.gemm_node(node)) for node in nodes]
    found = [(node, gemm) for node, gemm in gemms if gemm is not None]
    assert len(found) == 1
    node, gemm = found[0]
    assert gemm.x is not None and torch.equal(gemm.x, x.reshape(8, 3))
    assert gemm.bias is get_gradient_edge(lin.bias).node
    assert compat.transposed_input(gemm.weight) is get_gradient_edge(lin.weight).node
    # the input's gradient leaves by edge x_edge, towards x
    below = node.next_functions[gemm.x_edge][0]
    assert below is not None and below is not gemm.weight and below is not gemm.bias


def test_x_at_w_reads_as_an_untransposed_gemm() -> None:
    w = nn.Parameter(torch.randn(3, 5))
    b = nn.Parameter(torch.randn(5))
    x = torch.randn(4, 3, requires_grad=True)
    gemm = compat.gemm_node(torch.addmm(b, x, w).grad_fn)
    assert gemm is not None and gemm.x is not None and torch.equal(gemm.x, x)
    assert gemm.weight is get_gradient_edge(w).node and compat.transposed_input(gemm.weight) is None
    mm = compat.gemm_node(torch.mm(x, w).grad_fn)
    assert mm is not None and mm.bias is None and mm.x_edge == 0 and mm.weight is gemm.weight


def test_a_scaled_addmm_is_no_plain_gemm() -> None:
    w, b = nn.Parameter(torch.randn(3, 5)), nn.Parameter(torch.randn(5))
    x = torch.randn(4, 3)
    assert compat.gemm_node(torch.addmm(b, x, w, alpha=2.0).grad_fn) is None
    assert compat.gemm_node(torch.addmm(b, x, w, beta=0.5).grad_fn) is None
    assert compat.gemm_node((x @ w * 2).grad_fn) is None


def test_both_kinds_of_parameter_hooks_are_seen() -> None:
    w = nn.Parameter(torch.randn(2, 2))
    assert not compat.has_grad_hooks(w)
    handle = w.register_hook(lambda grad: grad)
    assert compat.has_grad_hooks(w)
    handle.remove()
    assert not compat.has_grad_hooks(w)
    handle = w.register_post_accumulate_grad_hook(lambda param: None)
    assert compat.has_grad_hooks(w)
    handle.remove()


def test_the_fused_backward_fuses_on_this_torch() -> None:
    """The fast path engages end to end: the layers are found, and the weight gradient
    lands in the buffer the fused accumulation was lent (autograd would make its own)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    x = torch.randn(4, 16, requires_grad=True)
    out = model(x)
    order, consumers = _walk([out.grad_fn])
    assert len(_linears(order, consumers, model.parameters())) == 2
    reference = torch.autograd.grad(out.square().sum(), list(model.parameters()), retain_graph=True)
    buffers = {}
    for p in model.parameters():
        p.grad = None
    pool = GradientPool()
    for lin in (model[0], model[2]):
        lin.weight.grad = torch.full_like(lin.weight, float("nan"))
        buffers[id(lin.weight)] = lin.weight.grad
        pool.lend(lin.weight, lin.weight.grad)   # as a fused accumulation last step would
    pool.release(model.parameters())
    fused_backward([out.square().sum()], [None], [x], list(model.parameters()), pool=pool,
                   min_elements=0)
    for p, expected in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, expected)
        if id(p) in buffers:
            assert p.grad is buffers[id(p)]


@pytest.mark.parametrize("version", [(2, 10), (2, 16), (3, 0)])
def test_an_unsupported_torch_turns_the_fused_path_off_saying_why(
        version: tuple[int, int], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pipetrain.compat"):
        assert compat._decide(version) is False
    assert "fused weight-gradient accumulation is off" in caplog.text
    assert "2.11 to 2.15" in caplog.text


def test_a_failing_probe_turns_the_fused_path_off_saying_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def gone(node: object) -> None:
        raise AttributeError("'AddmmBackward0' object has no attribute '_saved_mat1'")

    monkeypatch.setattr(compat, "_read_gemm", gone)
    with caplog.at_level(logging.WARNING, logger="pipetrain.compat"):
        assert compat._decide(compat.OLDEST_TORCH) is False
    assert "_saved_mat1" in caplog.text


def test_meta_models_are_exported_on_meta_inputs_before_torch_2_13() -> None:
    assert compat.export_meta_models_on_meta_inputs((2, 11))
    assert compat.export_meta_models_on_meta_inputs((2, 12))
    assert not compat.export_meta_models_on_meta_inputs((2, 13))
    assert not compat.export_meta_models_on_meta_inputs((2, 15))
    assert compat.export_meta_models_on_meta_inputs() == (compat.torch_version() < (2, 13))
