"""torchgpipe compatibility: the same attributes, sequence behaviour and checkpoint flags,
and the same results as ``torchgpipe.GPipe`` for the same code."""

from __future__ import annotations

import copy
import importlib
import threading

import pytest
import torch
from torch import nn

import pipetrain
from helpers.gpipe import assert_close, assert_grads_close, leaf, mlp

torchgpipe = pytest.importorskip("torchgpipe")


def test_attributes_like_torchgpipe():
    model = mlp(0)
    gpipe = pipetrain.GPipe(model, [1, 3, 2], devices=["cpu", "cpu", "cpu"], chunks=4,
                            checkpoint="always")
    assert gpipe.balance == [1, 3, 2]
    assert gpipe.devices == [torch.device("cpu")] * 3
    assert gpipe.chunks == 4
    assert gpipe.checkpoint == "always"
    assert isinstance(gpipe.partitions, nn.ModuleList) and len(gpipe.partitions) == 3
    assert [len(p) for p in gpipe.partitions] == [1, 3, 2]
    assert all(isinstance(p, nn.Sequential) for p in gpipe.partitions)
    # the same keys as torchgpipe's state dict: partitions.<j>.<layer name>.<param>
    theirs = torchgpipe.GPipe(copy.deepcopy(mlp(0)), [1, 3, 2], devices=["cpu"] * 3)
    assert list(gpipe.state_dict()) == list(theirs.state_dict())


def test_sequence_behaviour():
    model = mlp(0)
    layers = list(model)
    gpipe = pipetrain.GPipe(model, [2, 4])
    assert len(gpipe) == 6
    assert list(gpipe) == layers
    assert gpipe[0] is layers[0] and gpipe[5] is layers[5]
    assert gpipe[-1] is layers[-1] and gpipe[-6] is layers[0]
    with pytest.raises(IndexError, match="6"):
        gpipe[6]
    with pytest.raises(IndexError):
        gpipe[-7]


def test_default_devices_on_a_cpu_machine():
    if torch.cuda.is_available():
        pytest.skip("the default devices are the CUDA devices here")
    gpipe = pipetrain.GPipe(mlp(0), [3, 3])
    assert gpipe.devices == [torch.device("cpu")] * 2
    assert gpipe.chunks == 1 and gpipe.checkpoint == "except_last"


class FlagRecorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool, int]] = []

    def forward(self, x):
        self.seen.append(
            (pipetrain.is_checkpointing(), pipetrain.is_recomputing(), threading.get_ident())
        )
        return x * 2


@pytest.mark.parametrize(
    ("checkpoint", "expected"),
    [
        # forwards in micro-batch order (checkpointed: (True, False)), then the
        # recomputations (False, True); 'except_last' leaves out the micro-batch whose
        # backward runs first, the last one (the backward runs last micro-batch first,
        # as torchgpipe's)
        ("always", [(True, False)] * 3 + [(False, True)] * 3),
        ("except_last", [(True, False)] * 2 + [(False, False)] + [(False, True)] * 2),
        ("never", [(False, False)] * 3),
    ],
)
def test_is_checkpointing_and_is_recomputing_inside_a_layer(checkpoint, expected):
    recorder = FlagRecorder()
    model = nn.Sequential(nn.Linear(3, 3), recorder, nn.Linear(3, 3))
    gpipe = pipetrain.GPipe(model, [1, 2], chunks=3, checkpoint=checkpoint)
    gpipe(torch.randn(6, 3)).sum().backward()
    assert sorted(flags[:2] for flags in recorder.seen) == sorted(expected)
    # forward order: the first passes are the forward ones, in micro-batch order
    assert [flags[:2] for flags in recorder.seen[:3]] == expected[:3]
    assert not pipetrain.is_checkpointing() and not pipetrain.is_recomputing()
    recorder.seen.clear()
    with torch.no_grad():
        gpipe(torch.randn(6, 3))
    assert [flags[:2] for flags in recorder.seen] == [(False, False)] * 3


def skip_model(package):
    skip = importlib.import_module(f"{package.__name__}.skip")

    @skip.skippable(stash=["s"])
    class Save(nn.Module):
        def forward(self, x):
            yield skip.stash("s", x)
            return torch.tanh(x)

    @skip.skippable(pop=["s"])
    class Add(nn.Module):
        def forward(self, x):
            return x + (yield skip.pop("s"))

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), Save(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), Add(),
        nn.Linear(8, 3),
    )


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_same_code_same_results_as_torchgpipe(checkpoint):
    def train(package):
        model = skip_model(package)
        gpipe = package.GPipe(model, balance=[2, 3, 2], devices=["cpu", "cpu", "cpu"],
                              chunks=4, checkpoint=checkpoint, deferred_batch_norm=True)
        optimizer = torch.optim.SGD(gpipe.parameters(), lr=0.1)
        torch.manual_seed(1)
        outputs, grads = [], []
        for _ in range(2):
            x = leaf(torch.randn(12, 5))  # even chunks: torchgpipe splits 10 as 3+3+3+1
            out = gpipe(x)
            optimizer.zero_grad()
            out.pow(2).mean().backward()
            outputs.append(out.detach())
            grads.append(x.grad)
            optimizer.step()
        return gpipe, outputs, grads

    ours, our_outputs, our_grads = train(pipetrain)
    theirs, their_outputs, their_grads = train(torchgpipe)
    for a, b in zip(our_outputs, their_outputs):
        assert_close(a, b, what="output")
    for a, b in zip(our_grads, their_grads):
        assert_close(a, b, what="input grad")
    assert_grads_close(ours.parameters(), theirs.parameters())
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert_close(a, b, what="weights after two steps")
    assert_close(ours[3].running_mean, theirs[3].running_mean, what="running_mean")
    assert int(ours[3].num_batches_tracked) == int(theirs[3].num_batches_tracked) == 2
    # torchgpipe stores the biased variance; pipetrain the unbiased one, as nn.BatchNorm
    # does: after two steps of 12 rows from running_var = 1 with momentum 0.1
    initial = (1 - 0.1) ** 2
    assert_close(ours[3].running_var - initial, (theirs[3].running_var - initial) * 12 / 11,
                 what="running_var")


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_checkpoint_flags_seen_by_a_layer_match_torchgpipe(checkpoint):
    def flags(package):
        seen = []

        class Layer(nn.Module):
            def forward(self, x):
                seen.append((package.is_checkpointing(), package.is_recomputing()))
                return x * 2

        model = nn.Sequential(nn.Linear(3, 3), Layer(), nn.Linear(3, 3))
        gpipe = package.GPipe(model, [1, 2], devices=["cpu", "cpu"], chunks=4,
                              checkpoint=checkpoint)
        gpipe(torch.randn(8, 3)).sum().backward()
        return sorted(seen)

    assert flags(pipetrain) == flags(torchgpipe)


class Graphs(nn.Module):
    """Counts the micro-batches whose activations (autograd graph) it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.alive = 0
        self.peak = 0
        self.lock = threading.Lock()

    def forward(self, x):
        y = self.linear(x)
        if torch.is_grad_enabled():  # not a checkpointed first pass: activations kept
            with self.lock:
                self.alive += 1
                self.peak = max(self.peak, self.alive)
            y.register_hook(self.freed)
        return y

    def freed(self, grad):
        with self.lock:
            self.alive -= 1


def test_no_checkpointed_forward_runs_beside_the_micro_batch_kept_whole():
    # 'except_last' as torchgpipe: on each partition the checkpointed micro-batches'
    # forwards run before the last one's, whose activations are then the first to go
    # (backward last first)
    layers = [Graphs(), Graphs()]
    alive_at_checkpointed = []
    original = Graphs.forward

    def forward(self, x):
        if pipetrain.is_checkpointing():
            alive_at_checkpointed.append(self.alive)  # whole graphs this partition holds
        return original(self, x)

    for layer in layers:
        layer.forward = forward.__get__(layer)
    gpipe = pipetrain.GPipe(nn.Sequential(*layers), [1, 1], devices=["cpu"] * 2, chunks=4,
                            checkpoint="except_last")
    gpipe(torch.randn(8, 4)).sum().backward()
    assert len(alive_at_checkpointed) == 2 * 3
    assert alive_at_checkpointed == [0] * 6
    assert [layer.peak for layer in layers] == [1, 1]


@pytest.mark.parametrize(("checkpoint", "peak"), [("always", 1), ("except_last", 1), ("never", 4)])
def test_peak_activations_per_partition_match_torchgpipe(checkpoint, peak):
    def peaks(package, **options):
        layers = [Graphs(), Graphs(), Graphs()]
        gpipe = package.GPipe(nn.Sequential(*layers), [1, 1, 1], devices=["cpu"] * 3,
                              chunks=4, checkpoint=checkpoint, **options)
        gpipe(torch.randn(8, 4)).sum().backward()
        assert all(layer.alive == 0 for layer in layers)
        return [layer.peak for layer in layers]

    # the default (recompute_ahead=0): idle workers help only a partition that holds no
    # graph at all, so no partition holds more than under torchgpipe
    assert peaks(pipetrain) == peaks(torchgpipe) == [peak] * 3
    # recompute_ahead=1 lets them rebuild one micro-batch ahead: at most one graph more
    assert all(peak <= p <= min(peak + 1, 4) for p in peaks(pipetrain, recompute_ahead=1))
