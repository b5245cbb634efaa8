"""Gradient buffers kept across steps: reused only when asked for and nobody holds them."""

import copy
import weakref

import torch
from torch import nn

import pipetrain
from pipetrain.backward.gradient_pool import GradientPool
from pipetrain.runtime.cpu_tuning import ReusingGradientPool
from pipetrain.runtime.stage import StageCompute


def _weight() -> nn.Parameter:
    return nn.Parameter(torch.zeros(3, 3))


def test_a_released_buffer_is_taken_back():
    w = _weight()
    w.grad = torch.ones(3, 3)
    buffer = w.grad
    pool = GradientPool()
    pool.lend(w, buffer)  # a fused accumulation made it
    pool.release([w])
    assert w.grad is None
    assert pool.take(w) is buffer
    assert pool.take(w) is None  # taken once


def test_a_gradient_autograd_made_is_dropped_not_kept():
    """Bug: the pool kept every gradient at the end of a step, also those no fused
    accumulation would take back (biases, norms, embeddings, weights too small to
    fuse): autograd made fresh ones next step, and the kept copies added one gradient's
    size to each Pipeline worker's peak."""
    w, b = _weight(), nn.Parameter(torch.zeros(3))
    pool = GradientPool()
    w.grad, b.grad = torch.ones(3, 3), torch.ones(3)
    dropped = weakref.ref(b.grad)
    pool.lend(w, w.grad)
    pool.release([w, b])
    assert b.grad is None and dropped() is None and len(pool) == 1
    w.grad = torch.ones(3, 3)  # a step where w was not fused: its kept buffer goes too
    pool.release([w])
    assert len(pool) == 0 and w.grad is None


def test_lent_buffers_are_not_kept_by_default():
    w = _weight()
    pool = GradientPool()
    w.grad = torch.ones(3, 3)
    dropped = weakref.ref(w.grad)
    pool.lend(w, w.grad)
    w.grad = None
    assert dropped() is None and len(pool) == 0  # freed: the pool keeps nothing
    assert pool.take(w) is None


def test_a_lent_buffer_dropped_by_zero_grad_is_reused():
    w = _weight()
    pool = ReusingGradientPool()
    w.grad = torch.ones(3, 3)
    pointer = w.grad.data_ptr()
    pool.lend(w, w.grad)
    w.grad = None
    taken = pool.take(w)
    assert taken is not None and taken.data_ptr() == pointer


def test_a_lent_buffer_the_user_still_holds_is_left_to_them():
    w = _weight()
    pool = ReusingGradientPool()
    w.grad = torch.ones(3, 3)
    kept = w.grad
    pool.lend(w, w.grad)
    w.grad = None
    assert pool.take(w) is None
    assert torch.equal(kept, torch.ones(3, 3))


def test_a_lent_buffer_whose_memory_a_view_holds_is_left_alone():
    w = _weight()
    pool = ReusingGradientPool()
    w.grad = torch.ones(3, 3)
    view = w.grad.view(9)
    pool.lend(w, w.grad)
    w.grad = None
    assert pool.take(w) is None
    assert torch.equal(view, torch.ones(9))


def test_a_buffer_of_another_shape_is_not_reused():
    w = _weight()
    pool = GradientPool()
    w.grad = torch.ones(3, 3)
    pool.lend(w, w.grad)
    pool.release([w])
    w.data = torch.zeros(4, 4)
    assert pool.take(w) is None


def _train(gpipe: nn.Module, x: torch.Tensor, steps: int, keep: list | None = None):
    """Train ``steps`` steps; the weak references to the first weight's gradient."""
    weight = gpipe.partitions[0][0].weight
    grads = []
    for _ in range(steps):
        gpipe.zero_grad(set_to_none=True)
        gpipe(x).square().sum().backward()
        grads.append(weakref.ref(weight.grad))
        if keep is not None:
            keep.append(weight.grad)
    return grads


def test_a_stage_keeps_no_dropped_gradient_by_default():
    # layers large enough to be fused (smaller weights are left to autograd)
    stage = StageCompute(nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512)),
                         stage_index=0, device=torch.device("cpu"))
    for key in range(2):
        stage.forward(key, torch.randn(3, 512), checkpointed=False)
        stage.backward(key, [torch.ones(3, 512)])
        first = weakref.ref(stage.module[0].weight.grad)
        stage.module.zero_grad(set_to_none=True)
        assert first() is None and len(stage.gradient_pool) == 0  # freed, not kept
    assert pipetrain.GPipe(nn.Sequential(nn.Linear(2, 2)), [1]).reuse_gradient_buffers is False


def test_gpipe_writes_the_next_steps_gradient_into_the_dropped_buffer():
    torch.manual_seed(0)
    # layers large enough to be fused (smaller weights are left to autograd)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))
    reference = copy.deepcopy(model)
    x = torch.randn(6, 512)
    gpipe = pipetrain.GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=3,
                            reuse_gradient_buffers=True)
    pointers = []
    for _ in range(3):
        gpipe.zero_grad(set_to_none=True)
        gpipe(x).square().sum().backward()
        pointers.append(gpipe.partitions[0][0].weight.grad.data_ptr())
    # the same memory each step (without the pool, zero_grad() would have freed it)
    assert pointers[0] == pointers[1] == pointers[2]
    reference(x).square().sum().backward()
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_gpipe_leaves_gradients_the_user_kept_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))
    x = torch.randn(6, 512)
    gpipe = pipetrain.GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=3,
                            reuse_gradient_buffers=True)
    kept: list[torch.Tensor] = []
    _train(gpipe, x, 1, keep=kept)
    first = kept[0].clone()
    with torch.no_grad():
        for p in gpipe.parameters():
            p.add_(0.5)  # the next step's gradient differs
    _train(gpipe, x, 1, keep=kept)
    assert torch.equal(kept[0], first)
    assert kept[1].data_ptr() != kept[0].data_ptr()
    assert not torch.equal(kept[1], first)


def test_a_stage_keeps_only_the_gradients_it_writes_into_again():
    stage = StageCompute(nn.Sequential(nn.Linear(512, 512), nn.LayerNorm(512)),
                         stage_index=0, device=torch.device("cpu"))
    linear = stage.module[0]
    for key in range(2):
        stage.forward(key, torch.randn(3, 512), checkpointed=False)
        stage.backward(key, [torch.ones(3, 512)])
        norm_grad = weakref.ref(stage.module[1].weight.grad)
        weight_grad = linear.weight.grad
        stage.release_gradients()
        assert norm_grad() is None  # autograd made it: dropped, as zero_grad() drops it
        assert len(stage.gradient_pool) == 1  # the fused weight's, for the next step
    assert stage.gradient_pool.take(linear.weight) is weight_grad
