"""Regression tests: one per bug found and fixed, each citing the bug."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.batchnorm import DeferredBatchNorm


class WithScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.linear(x) * self.scale, self.scale * 3


def test_0dim_output_gradient_is_counted_once_not_once_per_microbatch():
    """Bug: GPipe merges a 0-dim output by taking micro-batch 0's value, but its backward
    gave the whole gradient to every micro-batch, so parameters behind a 0-dim output got
    ``chunks`` times their gradient (gpipe.py/local_step.py ``_split``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), WithScale())
    gpipe = pipetrain.GPipe(copy.deepcopy(model), [1, 1], chunks=4)
    x = torch.randn(8, 3)
    out, scalar = gpipe(x)
    assert scalar.shape == ()
    (out.sum() + scalar).backward()
    expected_out, expected_scalar = model(x)
    (expected_out.sum() + expected_scalar).backward()
    assert torch.allclose(gpipe[1].scale.grad, model[1].scale.grad, atol=1e-5)


class Detach(nn.Module):
    def forward(self, x):
        return x.detach()


def test_last_stage_output_needing_grad_in_some_microbatches_only():
    """Bug: with checkpoint='except_last', a checkpointed micro-batch announces its
    outputs as needing a gradient before knowing; the last (not checkpointed) one finds
    its output needs none. The output gradients were sliced with micro-batch 0's mask
    for every micro-batch, and the backward failed with 'stage 1 has 0 outputs that
    need a gradient but received 1 gradients'."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), Detach())
    gpipe = pipetrain.GPipe(model, [1, 2], chunks=4, checkpoint="except_last")
    gpipe(torch.randn(8, 3)).sum().backward()
    assert gpipe[0].weight.grad is None or not gpipe[0].weight.grad.any()


def test_deepcopy_and_pickle_after_a_forward():
    """Bug: GPipe kept its random streams (holding a threading.Lock) outside the pipeline
    state that ``__getstate__`` drops, so ``copy.deepcopy`` or ``pickle`` of a GPipe that
    had run a forward with a dropout layer failed with "cannot pickle '_thread.lock'"."""
    gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.1)), [1, 1], chunks=2)
    gpipe(torch.randn(4, 3)).sum().backward()
    for twin in (copy.deepcopy(gpipe), pickle.loads(pickle.dumps(gpipe))):
        twin(torch.randn(4, 3)).sum().backward()
        assert twin[0].weight.grad is not None


def dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 4))


def test_recomputation_after_a_later_forward_repeats_its_own_masks():
    """Bug: every forward re-seeded the shared step seed of the random streams, so when
    two forwards ran before one backward, the checkpointed micro-batches of the first
    were recomputed with the second forward's seed: other dropout masks, wrong
    gradients (gpipe.py ``_rng.new_step()``; now a seed per forward call)."""
    grads = {}
    for mode in ("always", "never"):
        gpipe = pipetrain.GPipe(dropout_model(), [2, 1], chunks=2, checkpoint=mode)
        torch.manual_seed(5)
        x = torch.randn(4, 4)
        (gpipe(x).sum() + gpipe(x).pow(2).sum()).backward()
        grads[mode] = [p.grad for p in gpipe.parameters()]
    for a, b in zip(grads["always"], grads["never"]):
        assert torch.allclose(a, b, atol=1e-6)


def test_same_seed_same_masks_on_later_calls():
    """Bug: the random streams were keyed by the micro-batch's key, which includes the
    forward call's offset (the call count), so ``torch.manual_seed(s)`` before two runs
    of the same GPipe gave different dropout masks."""
    gpipe = pipetrain.GPipe(dropout_model(), [2, 1], chunks=2)
    x = torch.randn(4, 4)
    outputs = []
    for _ in range(2):
        torch.manual_seed(3)
        outputs.append(gpipe(x))
    assert torch.equal(outputs[0], outputs[1])


def test_no_grad_training_forward_commits_deferred_batch_norm():
    """Bug: a batch smaller than ``chunks`` gives fewer micro-batches, so GPipe commits
    the deferred batch norms itself after the forward, but only on the autograd path: a
    training-mode forward under ``torch.no_grad()`` left the statistics uncommitted
    (nn.BatchNorm updates them there)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4))
    plain = copy.deepcopy(model)
    gpipe = pipetrain.GPipe(model, [1, 1], chunks=4, deferred_batch_norm=True)
    x = torch.randn(3, 2, 2, 2)  # 3 micro-batches of one sample
    with torch.no_grad():
        gpipe(x)
        plain(x)
    bn = gpipe[1]
    assert isinstance(bn, DeferredBatchNorm)
    assert int(bn.num_batches_tracked) == 1
    assert torch.allclose(bn.running_mean, plain[1].running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var, plain[1].running_var, atol=1e-6)


class Fail(nn.Module):
    def forward(self, x):
        raise KeyError("layer failed")


@pytest.mark.timeout(60)
def test_a_failure_is_noted_once_by_the_stage_that_raised():
    """Bug (runtime/executor.py): the thread transport wakes the other stages with the
    same exception object, and each of them added its own note, so the error also said
    'raised by rank 2 running action 2RF0' for a stage that only waited."""
    gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(2, 2), Fail(), nn.Linear(2, 2)),
                            [1, 1, 1], chunks=2)
    with pytest.raises(KeyError) as info:
        gpipe(torch.randn(4, 2))
    notes = info.value.__notes__
    assert len(notes) == 1 and notes[0].startswith("pipetrain: raised by rank 1 running action 1F0")


def test_double_backward_is_refused_instead_of_silently_not_differentiable():
    """Bug: ``torch.autograd.grad(gpipe(x).sum(), x, create_graph=True)`` returned a
    gradient that did not require grad, so a gradient penalty built on it silently
    contributed nothing to training (torchgpipe supports it). Now a clear error."""
    gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)),
                            [2, 1], chunks=2)
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"does not support double backward(.|\n)*fix:"):
        torch.autograd.grad(gpipe(x).sum(), x, create_graph=True)
    (grad,) = torch.autograd.grad(gpipe(x).sum(), x)  # the first-order gradient works
    assert grad.shape == x.shape


def test_stage_workers_leave_other_threads_intra_op_count_alone():
    """Bug (runtime/workers.py): each CPU stage worker calls ``torch.set_num_threads`` to
    take its share of the cores, which also sets the count every thread started later
    begins with (torch keeps a process-wide default), so after a GPipe step other
    threads (torchgpipe's workers, a user's thread pool) ran with one intra-op thread.
    The worker threads keep their share; the default is restored."""
    import threading

    seen: list[int] = []

    class Count(nn.Module):
        def forward(self, x):
            seen.append(torch.get_num_threads())
            return x

    before = torch.get_num_threads()
    gpipe = pipetrain.GPipe(nn.Sequential(Count(), Count()), [1, 1], chunks=2)
    gpipe(torch.randn(2, 2))
    assert seen == [max(1, before // 2)] * 4  # each stage takes its share
    seen.clear()
    gpipe(torch.randn(1, 2))  # one micro-batch: the caller's thread runs both, with its count
    assert seen == [before] * 2
    in_new_thread: list[int] = []
    thread = threading.Thread(target=lambda: in_new_thread.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert in_new_thread == [before]
    assert torch.get_num_threads() == before


class FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rate = 0.5

    def forward(self, x):
        return nn.functional.dropout(x, self.rate, self.training)


def test_random_layer_of_an_unknown_type_recomputes_the_same_masks():
    """Bug: only stages holding known random layers (nn.Dropout, ..., a ``dropout``
    attribute) were seeded; a stage calling ``F.dropout`` (or ``torch.rand``) in a custom
    layer drew from the shared generator, and its recomputation drew other masks:
    checkpoint='always' gave other gradients than 'never' (torchgpipe gets them equal).
    Now every stage is seeded until it was seen drawing nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), FunctionalDropout(), nn.Linear(16, 4))
    grads = {}
    for mode in ("always", "never"):
        gpipe = pipetrain.GPipe(copy.deepcopy(model), [2, 1], chunks=2, checkpoint=mode)
        torch.manual_seed(1)
        gpipe(torch.randn(4, 4)).sum().backward()
        grads[mode] = [p.grad for p in gpipe.parameters()]
    for a, b in zip(grads["always"], grads["never"]):
        assert torch.equal(a, b)


def test_except_last_holds_one_microbatch_of_activations_per_partition():
    """Bug: checkpoint='except_last' left the last micro-batch un-checkpointed, but the
    fill-drain schedule runs the backward in forward order (B0 first), so that
    micro-batch's activations stayed alive while micro-batch 0 was recomputed: two
    micro-batches of activations per partition at the peak, where torchgpipe (backward
    last micro-batch first) holds one. Now the micro-batch backwarded first is the one
    left out (StepIO.checkpoint_start). With ``recompute_ahead`` (idle workers rebuild
    a graph ahead, opt-in) a partition holds at most one more."""
    import threading

    alive = {"now": 0, "peak": 0}
    lock = threading.Lock()

    class Held(nn.Module):
        def forward(self, x):
            y = x * 2
            if torch.is_grad_enabled():
                with lock:
                    alive["now"] += 1
                    alive["peak"] = max(alive["peak"], alive["now"])
                y.register_hook(lambda g: alive.__setitem__("now", alive["now"] - 1))
            return y

    for ahead, peak in ((0, 1), (1, 2)):
        alive.update(now=0, peak=0)
        gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(3, 3), Held()), [1, 1], chunks=4,
                                checkpoint="except_last", recompute_ahead=ahead)
        gpipe(torch.randn(8, 3)).sum().backward()
        assert alive["now"] == 0 and alive["peak"] <= peak
        if ahead == 0:
            assert alive["peak"] == 1


def test_fused_weight_gradients_do_not_record_a_graph() -> None:
    """Bug: the fused accumulation ``W.grad.addmm_(g.T, x)`` ran with autograd on while
    ``x`` (a saved activation) required grad, so ``W.grad`` recorded a graph (keeping
    activations alive), and a pooled buffer failed with "functions with out=... don't
    support automatic differentiation"."""
    import torch
    from torch import nn

    from pipetrain.backward import GradientPool, fused_backward

    layers = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    pool = GradientPool()
    for _ in range(2):
        x = torch.randn(3, 4, requires_grad=True)
        out = layers(x)
        fused_backward([out], [torch.ones_like(out)], [x], list(layers.parameters()), pool=pool,
                       min_elements=0)  # fuse these small layers too
        for p in layers.parameters():
            assert p.grad is not None and not p.grad.requires_grad and p.grad.grad_fn is None
        pool.release(layers.parameters())
