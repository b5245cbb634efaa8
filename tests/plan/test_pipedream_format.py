"""Reading PipeDream's graph.txt (``pipetrain/plan/pipedream_format.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.plan.pipedream_format import (
    PIPEDREAM_SOURCE,
    load_pipedream_graph,
    parse_pipedream_graph,
)

METRICS = "forward_compute_time={f}, backward_compute_time={b}, activation_size={a}, parameter_size={p}"


def node(node_id: str, description: str, f: float = 1.0, b: float = 2.0, a: str = "8.0",
         p: float = 0.0) -> str:
    return f"{node_id} -- {description} -- " + METRICS.format(f=f, b=b, a=a, p=p)


def text(*lines: str) -> str:
    return "\n".join(lines)


def test_units_names_and_order() -> None:
    # lines out of order, as PipeDream writes them (a dict's order)
    profile = parse_pipedream_graph(text(
        node("node3", "ReLU(inplace)", f=0.5, b=0.25, a="1024.000"),
        node("node2", "Conv2d(3, 64, kernel_size=(3, 3))", f=22.307, b=24.613, a="64.0", p=7168.0),
        "\tnode2 -- node3",
    ), batch_size=64)
    assert [x.name for x in profile.layers] == ["node2", "node3"]  # topological order
    conv, relu = profile.layers
    assert conv.description == "Conv2d(3, 64, kernel_size=(3, 3))"
    assert conv.forward_s == pytest.approx(0.022307) and conv.backward_s == pytest.approx(0.024613)
    assert (conv.output_bytes, conv.parameter_bytes) == (64, 7168)
    assert relu.output_bytes == 1024
    assert profile.edges == ((0, 1),)
    assert profile.source == PIPEDREAM_SOURCE and profile.batch_size == 64


def test_activation_lists_are_summed() -> None:
    profile = parse_pipedream_graph(node("node7", "LSTM(2048, 1024)",
                                         a="[6291456.0; 131072.0; 131072.0]"))
    assert profile.layers[0].output_bytes == 6291456 + 2 * 131072


def test_inputs_and_unused_getitems_are_dropped_as_pipedream_does() -> None:
    profile = parse_pipedream_graph(text(
        node("node1", "Input0"),
        node("node2", "Input1"),
        node("node4", "Embedding"),
        node("node7", "LSTM", a="[4.0; 2.0]"),
        node("node8", "__getitem__(0)"),   # used by node10: kept
        node("node9", "__getitem__(1)"),   # a sink: dropped
        node("node10", "Dropout"),
        node("node20", "hidden"),          # a source that is not an Input: kept
        "\tnode1 -- node4",
        "\tnode4 -- node7",
        "\tnode2 -- node7",
        "\tnode7 -- node8",
        "\tnode7 -- node9",
        "\tnode8 -- node10",
        "\tnode20 -- node10",
    ))
    names = [x.name for x in profile.layers]
    assert names == ["node4", "node7", "node8", "node20", "node10"]  # node10 needs node20
    assert profile.metadata["dropped"] == ["node1", "node2", "node9"]
    pairs = {(names[a], names[b]) for a, b in profile.edges}
    assert pairs == {("node4", "node7"), ("node7", "node8"), ("node8", "node10"),
                     ("node20", "node10")}


def test_stage_ids_of_partitioned_graphs_are_ignored() -> None:
    profile = parse_pipedream_graph(node("node2", "Linear") + " -- stage_id=3")
    assert profile.layers[0].name == "node2" and profile.layers[0].forward_s == 0.001


def test_missing_field_names_the_line_and_the_format() -> None:
    bad = "node3 -- ReLU -- forward_compute_time=1.0, activation_size=8.0, parameter_size=0.0"
    with pytest.raises(ValueError) as error:
        parse_pipedream_graph(text(node("node2", "Linear"), bad))
    message = str(error.value)
    assert "line 2" in message and "backward_compute_time" in message
    assert "forward_compute_time=F, backward_compute_time=G" in message  # the fix


def test_bad_number_and_unknown_edge_name_the_line() -> None:
    with pytest.raises(ValueError, match=r"line 1 .*activation_size='\[1; x\]'"):
        parse_pipedream_graph(node("node2", "Linear", a="[1; x]"))
    with pytest.raises(ValueError, match=r"line 2 .*'node9'"):
        parse_pipedream_graph(text(node("node2", "Linear"), "\tnode2 -- node9"))
    with pytest.raises(ValueError, match=r"line 1 .*expected a node line"):
        parse_pipedream_graph("node2 -- Linear")


def test_cycle_and_duplicate_are_refused() -> None:
    with pytest.raises(ValueError, match="cycle"):
        parse_pipedream_graph(text(node("node2", "A"), node("node3", "B"),
                                   "\tnode2 -- node3", "\tnode3 -- node2"))
    with pytest.raises(ValueError, match="defined twice"):
        parse_pipedream_graph(text(node("node2", "A"), node("node2", "B")))


def test_load_from_file_keeps_the_path(tmp_path: Path) -> None:
    path = tmp_path / "graph.txt"
    path.write_text(text(node("node2", "A"), node("node3", "B"), "\tnode2 -- node3") + "\n")
    profile = load_pipedream_graph(path)
    assert profile.num_layers == 2 and profile.metadata["path"] == str(path)
