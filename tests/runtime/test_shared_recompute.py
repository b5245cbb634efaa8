"""Shared re-materialization: idle workers rebuild other stages' checkpointed graphs."""

import copy
import threading
import time

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.runtime.shared_recompute import RecomputeSharing
from pipetrain.runtime.stage import StageCompute


class Recorded(nn.Module):
    """A linear layer that records which thread recomputed which input, and can be
    told to block or fail while recomputing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.recomputed: list[str] = []
        self.gate: threading.Event | None = None
        self.fail = False

    def forward(self, x):
        if pipetrain.is_recomputing():
            self.recomputed.append(threading.current_thread().name)
            if self.gate is not None:
                assert self.gate.wait(10)
            if self.fail:
                raise ValueError("recomputation failed on purpose")
        return self.linear(x)


def _stage(module: nn.Module, index: int = 0) -> StageCompute:
    return StageCompute(module, stage_index=index, device=torch.device("cpu"))


def _sharing(stages, limit=2, helpers=None):
    cond = threading.Condition()
    sharing = RecomputeSharing(stages, cond, helpers=helpers or [threading.get_ident()],
                               limit=limit, timeout=10)
    for stage in stages:
        stage.sharing = sharing
    return sharing, cond


def _reference_grads(module: nn.Module, inputs, grads):
    module = copy.deepcopy(module)
    for x, g in zip(inputs, grads):
        module(x).backward(g)
    return [p.grad for p in module.parameters()]


def test_a_helped_recomputation_is_not_repeated_by_its_owner():
    torch.manual_seed(0)
    module = Recorded()
    stage = _stage(module)
    sharing, cond = _sharing([stage])
    x, g = torch.randn(3, 4), torch.randn(3, 4)
    expected = _reference_grads(module, [x], [g])
    stage.forward(0, x, checkpointed=True)
    sharing.open(0, 1)
    with cond:
        assert sharing.help()
        assert not sharing.help()  # nothing left to rebuild
    stage.backward(0, [g])
    sharing.close()
    assert len(module.recomputed) == 1 and sharing.helped == 1
    for p, e in zip(module.parameters(), expected):
        torch.testing.assert_close(p.grad, e)


def test_the_owner_waits_for_the_helper_that_is_rebuilding_its_graph():
    module = Recorded()
    module.gate = threading.Event()
    stage = _stage(module)
    sharing, cond = _sharing([stage], helpers=[])
    stage.forward(0, torch.randn(2, 4), checkpointed=True)
    sharing.open(0, 1)

    def helper():
        sharing.helpers = frozenset([threading.get_ident()])
        with cond:
            sharing.help()

    helping = threading.Thread(target=helper, name="helper")
    helping.start()
    deadline = time.monotonic() + 5
    while not module.recomputed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert module.recomputed == ["helper"]  # blocked inside the recomputation
    done = threading.Event()

    def owner():
        stage.backward(0, [torch.ones(2, 4)])
        done.set()

    owning = threading.Thread(target=owner, name="owner")
    owning.start()
    assert not done.wait(0.2)  # the owner waits: its graph is not finished
    module.gate.set()
    assert done.wait(5)
    owning.join(5)
    helping.join(5)
    sharing.close()
    assert module.recomputed == ["helper"]  # rebuilt once, by the helper
    assert module.linear.weight.grad is not None


def test_an_error_in_a_helped_recomputation_is_raised_by_the_owner():
    module = Recorded()
    module.fail = True
    stage = _stage(module)
    sharing, cond = _sharing([stage])
    stage.forward(0, torch.randn(2, 4), checkpointed=True)
    sharing.open(0, 1)
    with cond:
        assert sharing.help()  # ran, and failed: the error waits for the owner
    with pytest.raises(ValueError, match="recomputation failed on purpose"):
        stage.backward(0, [torch.ones(2, 4)])
    sharing.close()


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_helpers_rebuild_no_more_graphs_than_the_limit(limit):
    module = Recorded()
    stage = _stage(module)
    sharing, cond = _sharing([stage], limit=limit)
    for key in range(4):
        stage.forward(key, torch.randn(2, 4), checkpointed=True)
    sharing.open(0, 4)
    with cond:
        ran = 0
        while sharing.help():
            ran += 1
    assert ran == limit and stage.graphs_held() == limit
    # the latest first: GPipe's backward runs last micro-batch first
    assert sorted(stage.pending_recomputations()) == list(range(4 - limit))
    # the owner's backward frees one graph: there is room for one more
    stage.backward(3, [torch.ones(2, 4)])
    with cond:
        assert sharing.help() == (limit < 4)
    sharing.close()


def test_help_is_refused_outside_a_run_and_to_other_threads():
    stage = _stage(Recorded())
    sharing, cond = _sharing([stage], helpers=[-1])
    stage.forward(0, torch.randn(2, 4), checkpointed=True)
    with cond:
        assert not sharing.help()  # not open
    sharing.open(0, 1)
    with cond:
        assert not sharing.help()  # this thread is not a helper
    sharing.close()


def test_keys_outside_the_open_range_are_left_alone():
    stage = _stage(Recorded())
    sharing, cond = _sharing([stage])
    stage.forward(5, torch.randn(2, 4), checkpointed=True)
    sharing.open(0, 4)
    with cond:
        assert not sharing.help()
    sharing.close()


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="limit must be at least 1"):
        RecomputeSharing([], threading.Condition(), helpers=[], limit=0)


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.05)
        return g


class Slow(nn.Module):
    def forward(self, x):
        return SlowBackward.apply(x)


def test_gpipe_workers_rebuild_each_others_graphs_with_the_same_gradients():
    """While the last partition runs its (slow) backwards on the caller's thread, the
    workers wait: with recompute_ahead=1 (opt-in: one graph more per partition) they
    rebuild the last partition's next graphs meanwhile (which worker gets to one first
    depends on the machine's load)."""
    torch.manual_seed(0)
    first, last = Recorded(), Recorded()
    model = nn.Sequential(first, last, Slow())
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4)
    reference(x).square().sum().backward()
    gpipe = pipetrain.GPipe(model, [1, 2], devices=["cpu", "cpu"], chunks=4,
                            checkpoint="always", recompute_ahead=1)
    gpipe(x).square().sum().backward()
    assert any(name.startswith("pipetrain-stage-") for name in last.recomputed), last.recomputed
    assert gpipe._local is not None and gpipe._local.sharing is not None
    assert gpipe._local.sharing.helped >= 1
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_gpipe_recompute_ahead_must_be_a_non_negative_integer():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"recompute_ahead must be a non-negative integer, got {bad!r}"):
            pipetrain.GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1],
                            recompute_ahead=bad)


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_a_waiting_worker_starts_rebuilding_while_the_caller_computes_its_loss():
    torch.manual_seed(0)
    first, last = Recorded(), Recorded()
    model = nn.Sequential(first, last)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4)
    gpipe = pipetrain.GPipe(model, [1, 1], devices=["cpu", "cpu"], chunks=4,
                            checkpoint="always", recompute_ahead=1)
    for _ in range(3):  # the first calls watch the partitions' random draws
        gpipe.zero_grad()
        gpipe(x).sum().backward()
    first.recomputed.clear()
    last.recomputed.clear()
    gpipe.zero_grad()
    out = gpipe(x)
    # no backward yet: worker 0 (whose backward starts by waiting) rebuilds meanwhile
    assert _wait_for(lambda: "pipetrain-stage-0" in first.recomputed + last.recomputed)
    out.square().sum().backward()
    assert len(first.recomputed) == len(last.recomputed) == 4  # each rebuilt once
    reference(x).square().sum().backward()
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class Noisy(Recorded):
    def forward(self, x):
        return nn.functional.dropout(super().forward(x), 0.5, self.training)


def test_partitions_that_draw_random_numbers_are_not_rebuilt_beside_the_callers_code():
    """A seeded partition sets torch's process-wide generator while it runs: rebuilding
    it while the caller computes its loss could disturb the caller's draws."""
    noisy, plain = Noisy(), Recorded()
    gpipe = pipetrain.GPipe(nn.Sequential(noisy, plain), [1, 1], devices=["cpu", "cpu"],
                            chunks=4, checkpoint="always")
    x = torch.randn(8, 4)
    for _ in range(3):
        gpipe(x).sum().backward()
    noisy.recomputed.clear()
    torch.manual_seed(5)
    out = gpipe(x)
    time.sleep(0.2)
    drawn = torch.rand(3)  # the caller's own draws, as in a loss with noise
    assert noisy.recomputed == []
    out.sum().backward()
    assert len(noisy.recomputed) == 4
    torch.manual_seed(5)
    gpipe(x)  # a forward draws one seed from the caller's generator, like this call did
    assert torch.equal(torch.rand(3), drawn)


def test_a_second_forward_before_backward_and_a_dropped_output_are_safe():
    torch.manual_seed(0)
    model = nn.Sequential(Recorded(), Recorded(), Recorded())
    reference = copy.deepcopy(model)
    gpipe = pipetrain.GPipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=4,
                            checkpoint="always")
    x1, x2 = torch.randn(8, 4), torch.randn(8, 4)
    dropped = gpipe(torch.randn(8, 4))  # never backwarded
    del dropped
    loss = gpipe(x1).square().sum() + gpipe(x2).sum()
    loss.backward()
    (reference(x1).square().sum() + reference(x2).sum()).backward()
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
