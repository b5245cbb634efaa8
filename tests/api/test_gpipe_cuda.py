"""GPipe on GPUs: each partition computes on its own CUDA stream, values cross devices on
copy streams, and outputs and gradients equal plain PyTorch's (fp32, 1e-5). Skipped
without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.runtime.streams import PipelineStreams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _model() -> nn.Sequential:
    """Eight layers, some with parameters autograd handles (LayerNorm), some fused (Linear)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256),
        nn.Tanh(), nn.Linear(256, 64), nn.GELU(), nn.Linear(64, 8),
    )


def _balance(num_partitions: int, num_layers: int = 8) -> list[int]:
    base, extra = divmod(num_layers, num_partitions)
    return [base + (j < extra) for j in range(num_partitions)]


def _train_and_compare(devices: list[str], checkpoint: str, *, steps: int = 3) -> None:
    """Several steps of GPipe and of the plain model (an SGD update in between, on the
    caller's stream: the next forward must see it); outputs and gradients agree."""
    model = _model()
    reference = copy.deepcopy(model).to(devices[-1] if devices[-1] != "cpu" else devices[0])
    gpipe = pipetrain.GPipe(model, _balance(len(devices)), devices=devices, chunks=4,
                            checkpoint=checkpoint)
    first = torch.device(devices[0])
    ref_device = next(reference.parameters()).device
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 32, device=first, requires_grad=True)
        x_ref = x.detach().to(ref_device).requires_grad_()
        out = gpipe(x)
        out.square().mean().backward()
        expected = reference(x_ref)
        expected.square().mean().backward()
        torch.testing.assert_close(out.to(ref_device), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad.to(ref_device), x_ref.grad, rtol=1e-5, atol=1e-5)
        for p, q in zip(gpipe.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.to(ref_device), q.grad, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            for p, q in zip(gpipe.parameters(), reference.parameters()):
                p.sub_(0.5 * p.grad)
                q.sub_(0.5 * q.grad)
        gpipe.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)


@needs_cuda
@pytest.mark.parametrize("num_partitions", [2, 3, 4])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_partitions_sharing_one_gpu_match_plain_pytorch(num_partitions, checkpoint):
    _train_and_compare(["cuda:0"] * num_partitions, checkpoint)


@needs_cuda
@pytest.mark.parametrize("devices", [["cpu", "cuda:0"], ["cuda:0", "cpu"],
                                     ["cuda:0", "cpu", "cuda:0"]])
def test_partitions_on_the_cpu_and_a_gpu_match_plain_pytorch(devices):
    _train_and_compare(devices, "except_last")


@needs_two_gpus
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_partitions_on_two_gpus_match_plain_pytorch(checkpoint):
    _train_and_compare(["cuda:0", "cuda:1", "cuda:0", "cuda:1"], checkpoint)


class StreamRecorder(nn.Module):
    """Records the CUDA stream current in its forward and in its output's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.forward_streams: set[int] = set()
        self.backward_streams: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_streams.add(torch.cuda.current_stream().cuda_stream)
        y = self.linear(x)
        if y.requires_grad:
            y.register_hook(lambda g: self.backward_streams.add(
                torch.cuda.current_stream().cuda_stream))
        return y


@needs_cuda
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_each_partition_computes_on_its_own_stream(checkpoint):
    recorders = [StreamRecorder() for _ in range(3)]
    gpipe = pipetrain.GPipe(nn.Sequential(*recorders), [1, 1, 1], devices=["cuda:0"] * 3,
                            chunks=2, checkpoint=checkpoint)
    gpipe(torch.randn(4, 8, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    streams = []
    for recorder in recorders:
        # forward, recomputation and backward on one stream per partition
        assert len(recorder.forward_streams) == 1
        assert recorder.backward_streams == recorder.forward_streams
        streams.append(next(iter(recorder.forward_streams)))
    assert len(set(streams)) == 3  # distinct: partitions sharing a GPU may overlap
    assert torch.cuda.default_stream().cuda_stream not in streams


@needs_cuda
def test_streams_are_made_only_for_pipelines_with_a_gpu_stage():
    assert PipelineStreams.needed([torch.device("cpu"), torch.device("cuda:0")])
    streams = PipelineStreams([torch.device("cpu"), torch.device("cuda:0")])
    assert streams.compute[0] is None and streams.compute[1] is not None
    assert streams.compute[1] != torch.cuda.default_stream(0)


def test_a_cpu_pipeline_has_no_streams():
    assert not PipelineStreams.needed([torch.device("cpu")] * 3)
    streams = PipelineStreams([torch.device("cpu")] * 3)
    assert streams.compute == streams.outgoing == streams.incoming == [None] * 3
    value = (torch.ones(2, requires_grad=True), "meta")
    shipped = streams.ship(value, 0, 1)
    assert shipped == (value, None) and streams.land(shipped, 1) is value
