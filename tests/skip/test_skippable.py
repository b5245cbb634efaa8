"""Tests for pipetrain.skip.skippable: @skippable layers in a plain nn.Sequential."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

from pipetrain.skip import (
    Namespace,
    SkipTracker,
    current_skip_tracker,
    pop,
    skippable,
    stash,
    use_skip_tracker,
    verify_skippables,
)


@skippable(stash=["skip"])
class Save(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(scale))

    def forward(self, x):
        yield stash("skip", x * self.scale)
        return x + 1


@skippable(pop=["skip"])
class Add(nn.Module):
    def forward(self, x):
        skip = yield pop("skip")
        return x * 10 + skip


@skippable(stash=["a", "b"], pop=["c"])
class Multi(nn.Module):
    def forward(self, x):
        c = yield pop("c")
        yield stash("b", x * 2)
        yield stash("a", x * 3)
        return x + c


def test_stash_and_pop_in_a_plain_sequential():
    model = nn.Sequential(Save(scale=2.0), nn.Identity(), Add())
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    out = model(x)
    assert out.tolist() == [(1 + 1) * 10 + 2, (2 + 1) * 10 + 4]
    out.sum().backward()
    # Through the skip: d(skip)/dx = scale = 2; through the main path: 10.
    assert x.grad.tolist() == [12.0, 12.0]
    assert model[0].module.scale.grad.item() == 3.0
    assert len(current_skip_tracker()) == 0  # popped: nothing left behind


def test_isolated_namespaces_let_pairs_share_a_name():
    outer, inner = Namespace(), Namespace()
    model = nn.Sequential(
        Save(scale=1.0).isolate(outer), Save(scale=100.0).isolate(inner),
        Add().isolate(inner), Add().isolate(outer),
    )
    verify_skippables(model)
    x = torch.tensor([1.0])
    # Save1: skip_o = 1, x = 2; Save2: skip_i = 200, x = 3; Add_i: 30 + 200; Add_o: 2300 + 1.
    assert model(x).tolist() == [2301.0]
    with pytest.raises(TypeError, match="redeclared 'skip' as stashable"):
        verify_skippables(nn.Sequential(Save(), Save(), Add(), Add()))


def test_isolate_only_some_names():
    ns = Namespace()
    layer = Multi().isolate(ns, only=["a"])
    assert layer.namespaced("a") == (ns, "a")
    assert layer.namespaced("b") == (None, "b")
    assert list(layer.stashable()) == [(ns, "a"), (None, "b")]
    assert list(layer.poppable()) == [(None, "c")]


def test_isolate_errors():
    with pytest.raises(TypeError, match=r"takes a Namespace, got 'ns'.*ns = Namespace\(\)"):
        Save().isolate("ns")
    # names it does not declare: torchgpipe accepts them, pipetrain warns
    ns = Namespace()
    with pytest.warns(UserWarning, match=r"does not declare, \['z'\].*only=\['a'\]"):
        layer = Multi().isolate(ns, only=["a", "z"])
    assert layer.namespaced("a") == (ns, "a") and "z" not in layer.namespaces
    # None is the default namespace, as in torchgpipe
    assert layer.isolate(None).namespaced("a") == (None, "a")


def test_several_commands_and_a_none_skip():
    @skippable(stash=["nothing"])
    class StashNone(nn.Module):
        def forward(self, x):
            yield stash("nothing", None)
            return x

    @skippable(pop=["nothing"], stash=["c"])
    class PopNone(nn.Module):
        def forward(self, x):
            value = yield pop("nothing")
            assert value is None
            yield stash("c", x)
            return x

    model = nn.Sequential(StashNone(), PopNone(), Multi())
    with use_skip_tracker(SkipTracker()) as tracker:
        out = model(torch.tensor([1.0]))
    assert out.tolist() == [2.0]
    remaining = tracker.remaining()
    assert {name: t.tolist() for (_, name), t in remaining.items()} == {"a": [3.0], "b": [2.0]}


def test_runtime_errors_name_the_layer_and_the_fix():
    @skippable(stash=["x"])
    class Undeclared(nn.Module):
        def forward(self, x):
            yield stash("y", x)
            return x

    @skippable(stash=["x"])
    class Forgets(nn.Module):
        def forward(self, x):
            return x

    @skippable(pop=["x"])
    class YieldsJunk(nn.Module):
        def forward(self, x):
            yield "hello"
            return x

    with pytest.raises(RuntimeError, match=r"Undeclared stashed 'y'.*@skippable\(stash="):
        Undeclared()(torch.ones(1))
    with pytest.raises(RuntimeError, match=r"Forgets declares.*'x' must be stashed but have not"):
        Forgets()(torch.ones(1))
    with pytest.raises(TypeError, match=r"'hello' is not a command.*YieldsJunk.forward yielded"):
        YieldsJunk()(torch.ones(1))
    with use_skip_tracker(SkipTracker()), pytest.raises(
        RuntimeError, match=r"Add pops 'skip' but 'skip' has not been stashed.*verify_skippables"
    ):
        Add()(torch.ones(1))


def test_default_trackers_are_per_thread():
    model = nn.Sequential(Save(), Add())
    results = {}

    def run(name: str, value: float) -> None:
        for _ in range(50):
            results[name] = model(torch.tensor([value])).item()

    threads = [threading.Thread(target=run, args=(str(v), v)) for v in (1.0, 2.0, 3.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert results == {"1.0": 21.0, "2.0": 32.0, "3.0": 43.0}


def test_copies_and_pickles_keep_the_skips_matching():
    ns = Namespace()
    model = nn.Sequential(Save(scale=3.0).isolate(ns), Add().isolate(ns))
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        verify_skippables(clone)
        assert clone(torch.tensor([1.0])).tolist() == [23.0]
        assert clone[0].namespaced("skip") == (ns, "skip")


def test_state_dict_keys_match_torchgpipe():
    torchgpipe_skip = pytest.importorskip("torchgpipe.skip")

    @torchgpipe_skip.skippable(stash=["skip"])
    class TheirSave(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            yield torchgpipe_skip.stash("skip", x)
            return x

    ours = nn.Sequential(Save(), Add()).state_dict()
    theirs = nn.Sequential(TheirSave(), nn.Identity()).state_dict()
    assert list(ours) == list(theirs) == ["0.module.scale"]
