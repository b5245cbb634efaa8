"""torchgpipe users change only the import: the names they use exist, called the same way."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch import nn

import pipetrain

torchgpipe = pytest.importorskip("torchgpipe")

# (torchgpipe module, pipetrain module, names)
NAMES = [
    ("torchgpipe.skip", "pipetrain.skip", ["skippable", "stash", "pop", "Namespace",
                                           "verify_skippables"]),
    ("torchgpipe.balance", "pipetrain.balance", ["balance_by_time", "balance_by_size"]),
    ("torchgpipe.batchnorm", "pipetrain.batchnorm", ["DeferredBatchNorm"]),
    ("torchgpipe", "pipetrain", ["is_checkpointing", "is_recomputing"]),
]


def parameters(function: object) -> list[tuple[str, object, object]]:
    """(name, kind, has default) of each parameter: what a caller relies on."""
    signature = inspect.signature(function)  # type: ignore[arg-type]
    return [
        (p.name, p.kind, p.default is inspect.Parameter.empty)
        for p in signature.parameters.values()
    ]


@pytest.mark.parametrize(("theirs", "ours", "names"), NAMES)
def test_names_exist_with_the_same_call_signature(theirs, ours, names):
    their_module = importlib.import_module(theirs)
    our_module = importlib.import_module(ours)
    for name in names:
        their_object = getattr(their_module, name)
        our_object = getattr(our_module, name)
        assert parameters(our_object)[: len(parameters(their_object))] == parameters(
            their_object
        ), name


def test_torchgpipe_keyword_defaults_match_where_they_matter():
    ours = inspect.signature(pipetrain.balance.balance_by_size).parameters
    theirs = inspect.signature(torchgpipe.balance.balance_by_size).parameters
    for name in ("chunks", "param_scale"):
        assert ours[name].default == theirs[name].default
    assert inspect.signature(pipetrain.balance.balance_by_time).parameters["timeout"].default == 1.0
    ours_bn = inspect.signature(pipetrain.batchnorm.DeferredBatchNorm).parameters
    theirs_bn = inspect.signature(torchgpipe.batchnorm.DeferredBatchNorm).parameters
    for name in ("eps", "momentum", "affine", "chunks"):
        assert ours_bn[name].default == theirs_bn[name].default


def test_lazy_top_level_names():
    assert pipetrain.is_checkpointing is pipetrain.checkpoint.is_checkpointing
    assert pipetrain.is_recomputing is pipetrain.checkpoint.is_recomputing
    assert pipetrain.skip.skippable is importlib.import_module("pipetrain.skip").skippable
    assert {"skip", "balance", "batchnorm"} <= set(dir(pipetrain))


def test_isolate_and_convert_have_torchgpipe_signatures():
    from torchgpipe.skip.skippable import Skippable as TheirSkippable

    from pipetrain.skip import Skippable

    assert parameters(Skippable.isolate) == parameters(TheirSkippable.isolate)
    convert = pipetrain.batchnorm.DeferredBatchNorm.convert_deferred_batch_norm
    their_convert = torchgpipe.batchnorm.DeferredBatchNorm.convert_deferred_batch_norm
    assert parameters(convert) == parameters(their_convert)


def test_a_torchgpipe_model_definition_runs_with_only_the_import_changed():
    source = '''
from torch import nn
from {package}.skip import Namespace, pop, skippable, stash, verify_skippables
from {package}.batchnorm import DeferredBatchNorm
from {package}.balance import balance_by_time

@skippable(stash=["1to3"])
class Layer1(nn.Module):
    def forward(self, input):
        yield stash("1to3", input)
        return input * 2

@skippable(pop=["1to3"])
class Layer3(nn.Module):
    def forward(self, input):
        skip = yield pop("1to3")
        return input + skip

ns = Namespace()
model = nn.Sequential(Layer1().isolate(ns), nn.BatchNorm1d(4), Layer3().isolate(ns))
verify_skippables(model)
model = DeferredBatchNorm.convert_deferred_batch_norm(model, 2)
balance = balance_by_time(2, model, sample, device="cpu", timeout=0.0)
output = model(sample)
'''
    results = {}
    for package in ("torchgpipe", "pipetrain"):
        torch.manual_seed(0)
        scope = {"sample": torch.randn(6, 4, 3)}
        exec(source.format(package=package), scope)
        results[package] = scope
    assert sum(results["pipetrain"]["balance"]) == 3
    assert torch.allclose(results["pipetrain"]["output"], results["torchgpipe"]["output"])
    assert isinstance(results["pipetrain"]["model"][1], nn.Module)
