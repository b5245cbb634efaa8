"""The transport with CUDA tensors over NCCL (two GPUs), and the communication stream
(one GPU). Skipped without them; written to run where they are."""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import run_workers
from helpers.transport_jobs import CUDA_PATHS, NUM_MICROBATCHES, cuda_paths_job
from pipetrain.runtime.comm_stream import CommStream

needs_one = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2,
                               reason="needs two CUDA devices (NCCL takes one device per rank)")


@needs_two
@pytest.mark.distributed
def test_device_tensors_travel_device_to_device_over_nccl() -> None:
    outcome = run_workers(cuda_paths_job, 2, timeout=300)
    for name, _ in CUDA_PATHS:
        # rank 0 receives 2 channels (gradients 1->0 and activations 1->2), rank 1 two too
        assert [checked[name] for checked in outcome] == [2 * NUM_MICROBATCHES] * 2, name


@needs_one
def test_sends_wait_for_the_compute_stream_and_receives_are_handed_to_it() -> None:
    device = torch.device("cuda", 0)
    streams = CommStream(device)
    assert streams.stream is not None
    compute = torch.cuda.current_stream(device)
    x = torch.randn(4096, 4096, device=device)
    y = x @ x  # queued on the compute stream
    with streams.sending([y]):
        assert torch.cuda.current_stream(device) == streams.stream
        copy = y.clone()  # runs on the communication stream, after the matmul
    assert torch.cuda.current_stream(device) == compute
    with streams.receiving():
        assert torch.cuda.current_stream(device) == streams.stream
        buffer = torch.empty(16, device=device)
        buffer.fill_(3.0)
    compute.wait_stream(streams.stream)
    streams.arrived([buffer])
    torch.cuda.synchronize(device)
    assert torch.equal(copy, x @ x) and torch.equal(buffer, torch.full((16,), 3.0, device=device))
