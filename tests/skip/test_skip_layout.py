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
    assert message.startswith("one or more pairs of stash and pop do not match")  # torchgpipe's
    assert "isolate(ns1)" in message and "Namespace()" in message  # the fix
    return [line[2:] for line in message.splitlines() if line.startswith("* ")]


def test_matched_pairs_pass():
    verify_skippables(nn.Sequential(Layer1(), nn.ReLU(), Layer3()))
    verify_skippables(nn.Sequential(nn.ReLU()))
    verify_skippables(unet(depth=3, channels=2))


def test_every_problem_is_listed_at_once():
    # torchgpipe's wording for each problem, then which layers
    assert problems(nn.Sequential(Layer1(), nn.ReLU())) == [
        "no module declared '1to3' as poppable but stashed: '0' stashes it and no later "
        "layer pops it"
    ]
    assert problems(nn.Sequential(nn.ReLU(), Layer3())) == [
        "'1' declared '1to3' as poppable but it was not stashed: no earlier layer stashes it"
    ]
    assert problems(nn.Sequential(Layer3(), Layer1())) == [
        "'0' declared '1to3' as poppable but it was not stashed: no earlier layer stashes it",
        "no module declared '1to3' as poppable but stashed: '1' stashes it and no later "
        "layer pops it",
    ]
    assert problems(nn.Sequential(Layer1(), nn.ReLU(), Layer3(), Layer3())) == [
        "'3' redeclared '1to3' as poppable but not isolated by namespace: '2' pops it already"
    ]
    assert problems(nn.Sequential(Layer1(), Layer1(), nn.ReLU(), Layer3())) == [
        "'1' redeclared '1to3' as stashable but not isolated by namespace: '0' stashes it "
        "already"
    ]
    assert problems(nn.Sequential(Both())) == [
        "'0' declared 'same' both as stashable and as poppable"
    ]


def test_namespaces_appear_in_messages():
    ns = Namespace()
    (problem,) = problems(nn.Sequential(Layer1().isolate(ns), Layer3()))[:1]
    assert problem == (
        "'1' declared '1to3' as poppable but it was not stashed: no earlier layer stashes it"
    )
    assert problems(nn.Sequential(Layer1().isolate(ns), Layer3()))[1] == (
        f"no module declared '1to3' as poppable but stashed (in {ns!r}): '0' stashes it and "
        f"no later layer pops it"
    )


def test_skippables_nested_in_a_child_count_as_the_child():
    block = nn.Sequential(Layer1(), nn.ReLU(), Layer3())  # internal skip
    verify_skippables(nn.Sequential(nn.ReLU(), block))
    opener = nn.Sequential(nn.Linear(2, 2), Layer1())
    model = nn.Sequential(opener, nn.ReLU(), Layer3())
    layout = skip_layout([model[:1], model[1:]])
    assert layout.routes == (SkipRoute((None, "1to3"), stash_stage=0, pop_stage=1),)
    assert problems(nn.Sequential(opener)) == [
        "no module declared '1to3' as poppable but stashed: '0.1' stashes it and no later "
        "layer pops it"
    ]


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
    with pytest.raises(TypeError, match=r"'1' declared '1to3' as poppable but it was not "
                                        r"stashed.*\n\* .*'2' stashes it"):
        skip_layout(split_module(model, [1, 2]))


def test_layout_is_plain_data():
    route = SkipRoute((None, "s"), stash_stage=0, pop_stage=1)
    layout = SkipLayout(2, routes=(route,))
    assert layout == SkipLayout(2, routes=(SkipRoute((None, "s"), stash_stage=0, pop_stage=1),))
    with pytest.raises(TypeError):
        SkipRoute((None, "s"), 0, 1)  # stages by keyword only
    assert layout.crossing(0) == ((None, "s"),)
