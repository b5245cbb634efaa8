"""Tests for pipetrain.skip.tracker, used the way the pipeline runtime will use it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from pipetrain.checkpoint import checkpoint
from pipetrain.microbatch import merge_batches, split_batch
from pipetrain.models.unet import unet
from pipetrain.partition import split_module
from pipetrain.skip import (
    SkipTracker,
    current_skip_tracker,
    run_with_skips,
    skip_layout,
    use_skip_tracker,
)


def test_tracker_is_a_plain_store():
    a, b = torch.ones(1), torch.zeros(1)
    tracker = SkipTracker({(None, "a"): a})
    tracker.stash((None, "b"), b)
    assert (None, "a") in tracker and len(tracker) == 2
    clone = tracker.copy()
    assert tracker.pop((None, "a")) is a
    assert list(tracker.remaining()) == [(None, "b")]
    assert list(clone.remaining()) == [(None, "a"), (None, "b")]  # copies are independent
    assert clone.remaining()[(None, "a")] is a  # tensors are not copied
    tracker.stash((None, "b"), a)  # overwrites
    assert tracker.pop((None, "b")) is a
    with pytest.raises(KeyError, match=r"no skip 'a' is stashed \(the tracker holds nothing\)"):
        tracker.pop((None, "a"))


def test_use_skip_tracker_nests_restores_and_stays_in_its_thread():
    default = current_skip_tracker()
    outer, inner = SkipTracker(), SkipTracker()
    seen_in_other_thread = []
    with use_skip_tracker(outer):
        assert current_skip_tracker() is outer
        with use_skip_tracker(inner):
            assert current_skip_tracker() is inner
            other = threading.Thread(
                target=lambda: seen_in_other_thread.append(current_skip_tracker())
            )
            other.start()
            other.join(timeout=10)
        assert current_skip_tracker() is outer
    assert current_skip_tracker() is default
    assert seen_in_other_thread[0] not in (outer, inner, default)


def test_run_with_skips_is_pure():
    model = unet(depth=2, channels=2)
    first, _ = split_module(model, [2, 9])
    x = torch.randn(2, 3, 8, 8)
    out1, skips1 = run_with_skips(first, x, {})
    out2, skips2 = run_with_skips(first, x, {})
    assert torch.equal(out1, out2)
    assert list(skips1) == list(skips2) == [model.down0.namespaced("skip")]
    assert len(current_skip_tracker()) == 0  # the thread's default tracker was not used


def receive(value: torch.Tensor) -> torch.Tensor:
    """What a transport does: a fresh leaf with the same values."""
    return value.detach().requires_grad_(value.requires_grad)


@pytest.mark.parametrize(
    ("use_checkpoint", "stage_threads"), [(False, False), (True, False), (True, True)]
)
def test_gradients_flow_through_skips_across_stages(use_checkpoint, stage_threads):
    """Run a 3-stage U-Net the way the runtime will, compare with the plain model.

    With ``stage_threads``, each stage's forwards run in that stage's own thread and
    the backward (with its recomputations) in the main thread.
    """
    model = unet(depth=2, channels=2, seed=1)
    x = torch.randn(5, 3, 8, 8)
    model(x).square().sum().backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    # stem down0 encode0 | down1 encode1 bottleneck up1 | merge1 up0 merge0 head:
    # skip0 crosses stage 1 untouched, skip1 crosses one boundary.
    partitions = split_module(model, [3, 4, 4])
    layout = skip_layout(partitions)
    num_stages = len(partitions)
    saved = {}  # (i, j) -> (inputs, skips_in, output, skips_out)
    outputs = []
    executors = [ThreadPoolExecutor(1, thread_name_prefix=f"stage{j}") for j in range(3)]
    for i, micro in enumerate(split_batch(x, 3)):
        value, skips = micro, {}
        for j, partition in enumerate(partitions):
            value = receive(value) if j > 0 else value
            skips = {key: receive(t) for key, t in skips.items()}
            assert set(skips) == set(layout.incoming(j))
            args = (run_with_skips, partition, value, skips)
            run = checkpoint if use_checkpoint else (lambda f, *a: f(*a))
            if stage_threads:
                output, skips_out = executors[j].submit(run, *args).result(timeout=60)
            else:
                output, skips_out = run(*args)
            assert set(skips_out) == set(layout.crossing(j))
            saved[i, j] = (value, skips, output, skips_out)
            value, skips = output, skips_out
        outputs.append(value)
    for executor in executors:
        executor.shutdown()

    for i in reversed(range(len(outputs))):
        grad_output, grad_skips = None, {}
        for j in reversed(range(num_stages)):
            value, skips, output, skips_out = saved[i, j]
            if j == num_stages - 1:
                output.square().sum().backward()
            else:
                keys = list(skips_out)
                torch.autograd.backward(
                    [output, *(skips_out[k] for k in keys)],
                    [grad_output, *(grad_skips[k] for k in keys)],
                )
            grad_output = value.grad
            grad_skips = {key: t.grad for key, t in skips.items()}
            assert all(g is not None for g in grad_skips.values())

    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, reference[name], rtol=1e-4, atol=1e-5), name
    assert torch.allclose(merge_batches(outputs), model(x), atol=1e-6)


def test_leftovers_in_the_default_tracker_do_not_break_the_next_forward():
    model = unet(depth=1, channels=2)
    sizes = []

    def run() -> None:  # in a new thread: a fresh default tracker
        with pytest.raises(ValueError, match="multiples of 2"):
            model(torch.randn(1, 3, 5, 5))
        partial = nn.Sequential(model.stem, model.down0)
        partial(torch.randn(1, 3, 4, 4))  # stashes a skip that nothing pops
        sizes.append(len(current_skip_tracker()))
        model(torch.randn(1, 3, 4, 4))  # overwrites it, then pops it
        sizes.append(len(current_skip_tracker()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert sizes == [1, 0]
