"""Cuts of a model's graph (``pipetrain/plan/graph.py``)."""

from __future__ import annotations

import pytest

from pipetrain.plan.graph import CutGraph
from pipetrain.plan.profile import LayerProfile, Profile

from .helpers import chain, graph


def test_a_sequence_has_its_prefixes_as_cuts() -> None:
    g = CutGraph(chain([1, 2, 3], outputs=[10, 20, 30], parameters=[1, 0, 5]))
    assert g.is_chain and g.num_cuts == 4
    assert [g.nodes_between(0, c) for c in range(4)] == [[], [0], [0, 1], [0, 1, 2]]
    assert g.boundary == [0.0, 10.0, 20.0, 0.0]  # the last node's output crosses no cut
    assert list(g.supersets(1)) == [2, 3]
    assert g.stage_sum("compute_s", 1, 3) == 5.0
    assert g.stage_sum("parameter_bytes", 0, 3) == 6.0


def test_a_diamond_has_cuts_that_are_not_prefixes_of_one_order() -> None:
    # a -> b -> d and a -> c -> d: {a, c} is a cut although c comes after b
    g = CutGraph(graph("abcd", [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")],
                       [1, 1, 1, 1], outputs=[1, 10, 100, 1000]))
    cuts = {frozenset("abcd"[v] for v in g.nodes_between(0, c)): c for c in range(g.num_cuts)}
    assert set(cuts) == {frozenset(), frozenset("a"), frozenset("ab"), frozenset("ac"),
                         frozenset("abc"), frozenset("abcd")}
    assert not g.is_chain
    # what crosses a cut: a's output while b or c is outside, and b's and c's outputs
    assert g.boundary[cuts[frozenset("a")]] == 1
    assert g.boundary[cuts[frozenset("ac")]] == 1 + 100
    assert g.boundary[cuts[frozenset("abc")]] == 10 + 100
    assert sorted(g.supersets(cuts[frozenset("ab")])) == [cuts[frozenset("abc")],
                                                           cuts[frozenset("abcd")]]
    assert g.contains(cuts[frozenset("a")], cuts[frozenset("ac")])
    assert not g.contains(cuts[frozenset("ab")], cuts[frozenset("ac")])


def test_duplicate_edges_count_once() -> None:
    layers = tuple(LayerProfile(name=n, forward_s=1.0, backward_s=0.0, output_bytes=5)
                   for n in "ab")
    g = CutGraph(Profile(layers=layers, edges=((0, 1), (0, 1))))
    assert g.boundary == [0.0, 5.0, 0.0]


def test_a_cycle_is_refused_naming_its_nodes() -> None:
    with pytest.raises(ValueError, match=r"cycle through the nodes \['a', 'b'\]"):
        CutGraph(graph("ab", [("a", "b"), ("b", "a")], [1, 1]))


def test_too_many_cuts_is_refused_with_advice() -> None:
    # s feeds 8 independent nodes: 1 + 2**8 cuts
    wide = graph("sabcdefgh", [("s", x) for x in "abcdefgh"], [1] * 9)
    with pytest.raises(ValueError, match=r"more than 100 cuts.*compress_branches"):
        CutGraph(wide, max_cuts=100)
    assert CutGraph(wide, max_cuts=257).num_cuts == 257


def test_a_stage_s_workspace_is_its_largest_node_s() -> None:
    """A backward runs one node at a time: a stage needs the most any of its nodes needs."""
    sizes = [5, 1, 9, 2, 7]
    g = CutGraph(Profile(layers=tuple(
        LayerProfile(name=str(k), forward_s=1.0, backward_s=1.0, backward_workspace_bytes=w,
                     backward_input_workspace_bytes=2 * w) for k, w in enumerate(sizes))))
    for a in range(g.full):
        ends = list(g.supersets(a))
        expected = [float(max(sizes[a:b])) for b in ends]
        assert g.max_column("workspace_bytes", a, ends) == expected
        assert [g.stage_max("workspace_bytes", a, b) for b in ends] == expected
        assert g.load(a, ends[-1]).input_workspace_bytes == 2 * expected[-1]
    diamond = CutGraph(Profile(
        layers=tuple(LayerProfile(name=n, forward_s=1.0, backward_s=1.0,
                                  backward_workspace_bytes=w) for n, w in zip("abcd", (1, 8, 3, 2))),
        edges=((0, 1), (0, 2), (1, 3), (2, 3))))
    starts_after_a = next(c for c in range(diamond.num_cuts) if diamond.nodes_between(0, c) == [0])
    ends = list(diamond.supersets(starts_after_a))
    assert diamond.max_column("workspace_bytes", starts_after_a, ends) == [
        float(max([1, 8, 3, 2][v] for v in diamond.nodes_between(starts_after_a, b))) for b in ends]
