"""Tests for pipetrain.skip.layout: verify_skippables and skip_layout."""

from __future__ import annotations

import pytest
from torch import nn

from pipetrain.models.unet import unet
from pipetrain.partition import split_module
from pipetrain.skip import (
    Namespace,
    SkipLayout,
    SkipRoute,
    pop,
    skip_layout,
    skippable,
    stash,
    verify_skippables,
)


@skippable(stash=["1to3"])
class Layer1(nn.Module):
    def forward(self, x):
        yield stash("1to3", x)
        return x


@skippable(pop=["1to3"])
class Layer3(nn.Module):
    def forward(self, x):
        return x + (yield pop("1to3"))


@skippable(stash=["same"], pop=["same"])
class Both(nn.Module):
    def forward(self, x):
        return x


def problems(model: nn.Module) -> list[str]:
    with pytest.raises(TypeError) as info:
        verify_skippables(model)
    message = str(info.value)
    assert message.startswith("one or more stash/pop pairs of skip connections do not match")
    assert "isolate(ns1)" in message and "Namespace()" in message  # the fix
    return [line[2:] for line in message.splitlines() if line.startswith("* ")]


def test_matched_pairs_pass():
    verify_skippables(nn.Sequential(Layer1(), nn.ReLU(), Layer3()))
    verify_skippables(nn.Sequential(nn.ReLU()))
    verify_skippables(unet(depth=3, channels=2))


def test_every_problem_is_listed_at_once():
    assert problems(nn.Sequential(Layer1(), nn.ReLU())) == [
        "'0' stashes '1to3' but no later layer pops it"
    ]
    assert problems(nn.Sequential(nn.ReLU(), Layer3())) == [
        "'1' pops '1to3' but no earlier layer stashes it"
    ]
    assert problems(nn.Sequential(Layer3(), Layer1())) == [
        "'0' pops '1to3' but no earlier layer stashes it",
        "'1' stashes '1to3' but no later layer pops it",
    ]
    assert problems(nn.Sequential(Layer1(), nn.ReLU(), Layer3(), Layer3())) == [
        "'3' pops '1to3', already popped by '2' (not isolated by a namespace)"
    ]
    assert problems(nn.Sequential(Layer1(), Layer1(), nn.ReLU(), Layer3())) == [
        "'1' stashes '1to3', already stashed by '0' (not isolated by a namespace)"
    ]
    assert problems(nn.Sequential(Both())) == ["'0' declares 'same' both as stash and as pop"]


def test_namespaces_appear_in_messages():
    ns = Namespace()
    (problem,) = problems(nn.Sequential(Layer1().isolate(ns), Layer3()))[:1]
    assert problem == "'1' pops '1to3' but no earlier layer stashes it"
    assert problems(nn.Sequential(Layer1().isolate(ns), Layer3()))[1] == (
        f"'0' stashes '1to3' in {ns!r} but no later layer pops it"
    )


def test_skippables_nested_in_a_child_count_as_the_child():
    block = nn.Sequential(Layer1(), nn.ReLU(), Layer3())  # internal skip
    verify_skippables(nn.Sequential(nn.ReLU(), block))
    opener = nn.Sequential(nn.Linear(2, 2), Layer1())
    model = nn.Sequential(opener, nn.ReLU(), Layer3())
    layout = skip_layout([model[:1], model[1:]])
    assert layout.routes == (SkipRoute((None, "1to3"), stash_stage=0, pop_stage=1),)
    assert problems(nn.Sequential(opener)) == ["'0.1' stashes '1to3' but no later layer pops it"]


def test_skip_layout_of_a_partitioned_unet():
    model = unet(depth=2, channels=2)
    # stem down0 encode0 | down1 encode1 bottleneck up1 | merge1 up0 merge0 head
    partitions = split_module(model, [3, 4, 4])
    layout = skip_layout(partitions)
    skip0, skip1 = model.down0.namespaced("skip"), model.down1.namespaced("skip")
    assert skip0 != skip1 and skip0[1] == skip1[1] == "skip"
    assert layout.num_stages == 3
    assert layout.routes == (
        SkipRoute(skip0, stash_stage=0, pop_stage=2),
        SkipRoute(skip1, stash_stage=1, pop_stage=2),
    )
    assert [layout.stashes(j) for j in range(3)] == [(skip0,), (skip1,), ()]
    assert [layout.pops(j) for j in range(3)] == [(), (), (skip0, skip1)]  # stash order
    assert [layout.crossing(j) for j in range(3)] == [(skip0,), (skip0, skip1), ()]
    assert [layout.incoming(j) for j in range(3)] == [(), (skip0,), (skip0, skip1)]
    assert layout.requires_copy(skip0) and layout.requires_copy(skip1)

    single = skip_layout([model])
    assert single.crossing(0) == () and not single.requires_copy(skip0)
    with pytest.raises(IndexError, match="stage index 3 is out of range for a layout of 3"):
        layout.crossing(3)


def test_layout_order_depends_only_on_structure():
    # Two processes building the same model get different namespace ids, same order.
    first, second = unet(depth=3, channels=2), unet(depth=3, channels=2)
    a = skip_layout(split_module(first, [4, 4, 7]))
    b = skip_layout(split_module(second, [4, 4, 7]))
    assert a.crossing(1) != b.crossing(1)  # different Namespace objects
    stashed_by = {}
    for model in (first, second):
        for name, layer in model.named_children():
            if name.startswith("down"):
                stashed_by[layer.namespaced("skip")] = name
    assert [stashed_by[k] for k in a.crossing(1)] == [stashed_by[k] for k in b.crossing(1)]
    assert [stashed_by[k] for k in a.crossing(0)] == ["down0", "down1"]
    assert [stashed_by[k] for k in a.crossing(1)] == ["down0", "down1", "down2"]
    assert [stashed_by[r.key] for r in a.routes] == ["down0", "down1", "down2"]


def test_skip_layout_rejects_unmatched_partitions():
    model = nn.Sequential(nn.ReLU(), Layer3(), Layer1())
    with pytest.raises(TypeError, match=r"'1' pops '1to3' but no earlier.*\n\* '2' stashes"):
        skip_layout(split_module(model, [1, 2]))


def test_layout_is_plain_data():
    route = SkipRoute((None, "s"), stash_stage=0, pop_stage=1)
    layout = SkipLayout(2, routes=(route,))
    assert layout == SkipLayout(2, routes=(SkipRoute((None, "s"), stash_stage=0, pop_stage=1),))
    with pytest.raises(TypeError):
        SkipRoute((None, "s"), 0, 1)  # stages by keyword only
    assert layout.crossing(0) == ((None, "s"),)
