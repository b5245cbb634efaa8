"""Reading PipeDream's profiles (its profiler's ``graph.txt``) as a :class:`Profile`.

PipeDream's profiler writes one node per line, then one tab-indented line per edge::

    node4 -- Conv2d(64, 64, ...) -- forward_compute_time=46.201, backward_compute_time=113.330, activation_size=1644167168.000, parameter_size=147712.000
    node5 -- ReLU(inplace) -- forward_compute_time=4.455, ...
    \tnode4 -- node5

Times are milliseconds per minibatch and sizes bytes; an ``activation_size`` may be a
list ``[a; b; c]`` (a node with several outputs), which is summed. A node line may end
with `` -- stage_id=K`` (PipeDream's partitioned graphs); it is ignored.

As PipeDream's optimizer does before planning, the reader drops the source nodes whose
description starts with ``Input`` (the data loader: its time is not the model's and the
input always goes to the first stage), and then the sink nodes whose description starts
with ``__getitem__`` (unused tuple items). The dropped node ids are listed in the
profile's ``metadata["dropped"]``. The other nodes keep PipeDream's ids as their
``name`` and are put in a topological order (file order among ready nodes).

Example:
    >>> text = '''node1 -- Input -- forward_compute_time=9.0, backward_compute_time=0.0, activation_size=8.0, parameter_size=0.0
    ... node2 -- Linear -- forward_compute_time=1.5, backward_compute_time=3.0, activation_size=[4.0; 4.0], parameter_size=64.0
    ... \\tnode1 -- node2'''
    >>> p = parse_pipedream_graph(text)
    >>> [(x.name, x.forward_s, x.backward_s, x.output_bytes) for x in p.layers]
    [('node2', 0.0015, 0.003, 8)]
    >>> p.metadata["dropped"]
    ['node1']
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass

from pipetrain.plan.profile import LayerProfile, Profile

__all__ = ["PIPEDREAM_SOURCE", "load_pipedream_graph", "parse_pipedream_graph"]

PIPEDREAM_SOURCE = "pipedream graph.txt"
"""The ``source`` of profiles read from PipeDream's format."""

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_EXAMPLE = (
    "nodeK -- description -- forward_compute_time=F, backward_compute_time=G, "
    "activation_size=A, parameter_size=P"
)


@dataclass
class _Node:
    node_id: str
    description: str
    values: dict[str, float]
    line: int


def _number(text: str, *, where: str, name: str) -> float:
    text = text.strip()
    try:
        if text.startswith("["):
            if not text.endswith("]"):
                raise ValueError
            return sum(float(x) for x in text[1:-1].split(";") if x.strip())
        return float(text)
    except ValueError:
        raise ValueError(
            f"{where}: {name}={text!r} is not a number (or a list [a; b] of numbers)"
        ) from None


def _parse_node(line: str, number: int) -> _Node:
    where = f"PipeDream graph line {number} ({line.strip()[:80]!r})"
    tokens = line.strip().split(" -- ")
    if tokens and tokens[-1].startswith("stage_id="):
        tokens = tokens[:-1]
    if len(tokens) < 3:
        raise ValueError(f"{where}: expected a node line like {_EXAMPLE!r}")
    values: dict[str, float] = {}
    for item in tokens[-1].split(", "):
        key, sep, value = item.partition("=")
        if sep and key.strip() in _FIELDS:
            values[key.strip()] = _number(value, where=where, name=key.strip())
    missing = [name for name in _FIELDS if name not in values]
    if missing:
        raise ValueError(
            f"{where}: missing field(s) {', '.join(missing)}; every node line reads "
            f"{_EXAMPLE!r} (times in ms, sizes in bytes)"
        )
    negative = [name for name in _FIELDS if values[name] < 0]
    if negative:
        raise ValueError(f"{where}: {negative[0]}={values[negative[0]]} must be >= 0")
    return _Node(tokens[0].strip(), " -- ".join(tokens[1:-1]).strip(), values, number)


def parse_pipedream_graph(text: str, *, batch_size: int = 1, name: str = "") -> Profile:
    """Parse the text of a PipeDream ``graph.txt`` (see the module docstring).

    ``batch_size`` records the minibatch size the profile was taken at (PipeDream's file
    does not say); ``name`` is kept in ``metadata["path"]``. Errors name the line.
    """
    nodes: dict[str, _Node] = {}
    edges: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if line.startswith("\t"):
            a, sep, b = line.strip().partition(" -- ")
            where = f"PipeDream graph line {number} ({line.strip()!r})"
            if not sep:
                raise ValueError(f"{where}: expected an edge line '\\tnodeA -- nodeB'")
            for end in (a.strip(), b.strip()):
                if end not in nodes:
                    raise ValueError(
                        f"{where}: edge names node {end!r}, which no line above defines; "
                        f"node lines come before the edge lines"
                    )
            edges.append((a.strip(), b.strip()))
            continue
        node = _parse_node(line, number)
        if node.node_id in nodes:
            raise ValueError(
                f"PipeDream graph line {number}: node {node.node_id!r} is defined twice "
                f"(first on line {nodes[node.node_id].line})"
            )
        nodes[node.node_id] = node
    if not nodes:
        raise ValueError(f"PipeDream graph {name or 'text'} has no node lines like {_EXAMPLE!r}")
    kept, dropped = _drop_inputs_and_getitems(nodes, edges)
    if not kept:
        raise ValueError("PipeDream graph: every node is an Input or __getitem__ node")
    order = _order(kept, edges)
    position = {node_id: k for k, node_id in enumerate(order)}
    layers = tuple(
        LayerProfile(
            name=node_id,
            description=nodes[node_id].description,
            forward_s=nodes[node_id].values["forward_compute_time"] / 1000.0,
            backward_s=nodes[node_id].values["backward_compute_time"] / 1000.0,
            output_bytes=round(nodes[node_id].values["activation_size"]),
            parameter_bytes=round(nodes[node_id].values["parameter_size"]),
        )
        for node_id in order
    )
    profile_edges = tuple(
        sorted({(position[a], position[b]) for a, b in edges if a in position and b in position})
    )
    return Profile(
        layers=layers,
        edges=profile_edges,
        batch_size=batch_size,
        source=PIPEDREAM_SOURCE,
        metadata={"dropped": dropped, "path": name},
    )


def _drop_inputs_and_getitems(
    nodes: dict[str, _Node], edges: list[tuple[str, str]]
) -> tuple[list[str], list[str]]:
    has_in = {b for _, b in edges}
    dropped = [n for n in nodes if n not in has_in and nodes[n].description.startswith("Input")]
    gone = set(dropped)
    has_out = {a for a, b in edges if a not in gone and b not in gone}
    sinks = [
        n
        for n in nodes
        if n not in gone and n not in has_out and nodes[n].description.startswith("__getitem__")
    ]
    dropped += sinks
    gone.update(sinks)
    return [n for n in nodes if n not in gone], dropped


def _order(kept: list[str], edges: list[tuple[str, str]]) -> list[str]:
    rank = {n: k for k, n in enumerate(kept)}
    successors: dict[str, set[str]] = {n: set() for n in kept}
    indegree = dict.fromkeys(kept, 0)
    for a, b in set(edges):
        if a in rank and b in rank:
            successors[a].add(b)
            indegree[b] += 1
    ready = [rank[n] for n in kept if indegree[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        n = kept[heapq.heappop(ready)]
        order.append(n)
        for s in successors[n]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, rank[s])
    if len(order) != len(kept):
        stuck = [n for n in kept if indegree[n] > 0]
        raise ValueError(f"PipeDream graph: the edges have a cycle through {stuck[:10]}")
    return order


def load_pipedream_graph(path: str | os.PathLike[str], *, batch_size: int = 1) -> Profile:
    """Read a PipeDream ``graph.txt`` file (see :func:`parse_pipedream_graph`).

    Example:
        >>> load_pipedream_graph("profiles/vgg16/graph.txt")  # doctest: +SKIP
    """
    with open(path, encoding="utf-8") as file:
        return parse_pipedream_graph(file.read(), batch_size=batch_size, name=os.fspath(path))
