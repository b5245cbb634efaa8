"""Shared helpers of the planner tests: small profiles and random ones."""

from __future__ import annotations

import random
from collections.abc import Sequence

from pipetrain.plan.costs import LevelContext
from pipetrain.plan.costs_pipedream import PipeDreamCostModel
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.search import FlatSearch

MODEL = PipeDreamCostModel()


def chain(
    compute: Sequence[float],
    *,
    outputs: Sequence[int] | None = None,
    parameters: Sequence[int] | None = None,
) -> Profile:
    """A layer sequence; layer k costs ``compute[k]`` seconds (all of it forward)."""
    n = len(compute)
    return Profile(
        layers=tuple(
            LayerProfile(
                name=str(k),
                forward_s=float(compute[k]),
                backward_s=0.0,
                output_bytes=0 if outputs is None else outputs[k],
                parameter_bytes=0 if parameters is None else parameters[k],
            )
            for k in range(n)
        )
    )


def graph(
    names: str,
    edges: Sequence[tuple[str, str]],
    compute: Sequence[float],
    *,
    outputs: Sequence[int] | None = None,
) -> Profile:
    """A DAG whose nodes are the letters of ``names``."""
    index = {name: k for k, name in enumerate(names)}
    return Profile(
        layers=tuple(
            LayerProfile(
                name=name,
                forward_s=float(compute[k]),
                backward_s=0.0,
                output_bytes=0 if outputs is None else outputs[k],
            )
            for k, name in enumerate(names)
        ),
        edges=tuple((index[a], index[b]) for a, b in edges),
    )


def search(
    profile: Profile,
    workers: int,
    *,
    bandwidth: float = 1e9,
    straight: bool = False,
    memory: float | None = None,
) -> FlatSearch:
    return FlatSearch(
        CutGraph(profile),
        model=MODEL,
        level=LevelContext(bandwidth=bandwidth),
        num_workers=workers,
        straight=straight,
        memory_limit=memory,
    )


def random_profile(rng: random.Random, num_nodes: int, *, dag: bool) -> Profile:
    """Random costs (some zero), and for a DAG one or two random predecessors per node."""
    layers = tuple(
        LayerProfile(
            name=f"n{k}",
            forward_s=rng.choice([0.0, rng.random()]),
            backward_s=rng.random(),
            output_bytes=rng.choice([0, rng.randrange(10**9)]),
            parameter_bytes=rng.choice([0, rng.randrange(10**9)]),
        )
        for k in range(num_nodes)
    )
    edges: set[tuple[int, int]] = set()
    if dag:
        for b in range(1, num_nodes):
            for a in rng.sample(range(b), k=min(b, rng.randint(1, 2))):
                edges.add((a, b))
    return Profile(layers=layers, edges=tuple(sorted(edges)))
