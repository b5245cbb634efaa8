"""GPipe's stage workers: one persistent thread per partition, kept between steps, and
partitions that share the CPU still run concurrently (shown with a barrier, not timings)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch import nn

import pipetrain


class ThreadRecorder(nn.Module):
    """Records the thread of every forward and backward through it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.forward_threads: list[int] = []
        self.backward_threads: list[int] = []

    def forward(self, x):
        self.forward_threads.append(threading.get_ident())
        y = self.linear(x)
        if y.requires_grad:
            y.register_hook(lambda g: self.backward_threads.append(threading.get_ident()))
        return y


def test_one_thread_per_partition_persisting_between_steps():
    recorders = [ThreadRecorder() for _ in range(3)]
    gpipe = pipetrain.GPipe(nn.Sequential(*recorders), [1, 1, 1], chunks=2,
                            checkpoint="never")
    for _ in range(3):
        gpipe(torch.randn(4, 4)).sum().backward()
    with torch.no_grad():
        gpipe(torch.randn(4, 4))
    threads = []
    for recorder in recorders:
        assert len(recorder.forward_threads) == 8 and len(recorder.backward_threads) == 6
        forward = set(recorder.forward_threads)
        assert len(forward) == 1  # the same thread in every step
        threads.append(forward.pop())
        # the backward runs where autograd runs it: on the caller's thread
        assert set(recorder.backward_threads) == {threading.get_ident()}
    # the last partition's forward runs on the caller's thread (which would only wait
    # meanwhile); the others each on a worker of their own
    assert threads[2] == threading.get_ident()
    assert len(set(threads)) == 3
    names = {t.ident: t.name for t in threading.enumerate()}
    assert [names[t] for t in threads[:2]] == [f"pipetrain-stage-{j}" for j in range(2)]


def test_a_single_partition_runs_on_the_callers_thread():
    # one intra-op thread team in the process, as plain PyTorch has
    recorder = ThreadRecorder()
    gpipe = pipetrain.GPipe(nn.Sequential(recorder), [1], chunks=2)
    gpipe(torch.randn(4, 4)).sum().backward()
    assert set(recorder.forward_threads) == set(recorder.backward_threads) == {
        threading.get_ident()}


def test_a_single_micro_batch_runs_every_partition_on_the_callers_thread():
    # nothing to overlap: the partitions run one after another, as plain PyTorch runs
    # the model (and each checkpointed one is recomputed right before its backward)
    recorders = [ThreadRecorder() for _ in range(3)]
    gpipe = pipetrain.GPipe(nn.Sequential(*recorders), [1, 1, 1], chunks=1,
                            checkpoint="always")
    x = torch.randn(4, 4, requires_grad=True)
    gpipe(x).sum().backward()
    with torch.no_grad():
        gpipe(torch.randn(4, 4))
    for recorder in recorders:
        assert set(recorder.forward_threads) == set(recorder.backward_threads) == {
            threading.get_ident()}
        assert len(recorder.forward_threads) == 3  # forward, recomputation, no-grad call
    reference = nn.Sequential(*(r.linear for r in recorders))
    y = x.detach().requires_grad_()
    reference(y).sum().backward()
    assert torch.allclose(x.grad, y.grad)


class Rendezvous(nn.Module):
    """Waits at a barrier on chosen calls: passes only if another stage waits at the
    same time, i.e. if two partitions run concurrently."""

    def __init__(self, barrier: threading.Barrier, calls: set[int]) -> None:
        super().__init__()
        self.barrier = barrier
        self.calls = calls
        self.count = 0
        self.met = 0

    def forward(self, x):
        self.count += 1
        if self.count in self.calls:
            self.barrier.wait()  # raises BrokenBarrierError after the timeout
            self.met += 1
        return x + 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("grad", [True, False])
def test_partitions_on_the_same_cpu_run_concurrently(grad):
    barrier = threading.Barrier(2, timeout=20)
    first, second = Rendezvous(barrier, set()), Rendezvous(barrier, set())
    gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(3, 3), first, second), [2, 1],
                            devices=["cpu", "cpu"], chunks=3, checkpoint="never")
    # GPipe watches the stages' random draws during their first two training calls
    # (and serializes them meanwhile); these draw nothing and then run freely
    for _ in range(2):
        gpipe(torch.randn(6, 3)).sum().backward()
    # stage 1 runs micro-batch 0 while stage 0 runs micro-batch 1: both wait together
    first.count = second.count = 0
    first.calls, second.calls = {2}, {1}
    with torch.set_grad_enabled(grad):
        out = gpipe(torch.randn(6, 3))
    assert first.met == 1 and second.met == 1
    assert out.shape == (6, 3)


@pytest.mark.timeout(60)
def test_the_barrier_breaks_when_partitions_are_serialized():
    """Control: torchgpipe runs the partitions of one device on one thread."""
    torchgpipe = pytest.importorskip("torchgpipe")
    barrier = threading.Barrier(2, timeout=1)
    model = nn.Sequential(nn.Linear(3, 3), Rendezvous(barrier, {2}), Rendezvous(barrier, {1}))
    gpipe = torchgpipe.GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=3,
                             checkpoint="never")
    with pytest.raises(threading.BrokenBarrierError):
        gpipe(torch.randn(6, 3))


def test_workers_stop_when_the_gpipe_is_collected():
    gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1])
    gpipe(torch.randn(2, 2)).sum().backward()
    workers = gpipe._pipeline().workers
    threads = list(workers._threads)
    assert all(t.is_alive() for t in threads)
    del gpipe, workers
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
