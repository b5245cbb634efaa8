"""Case ``planner_speed``: how long the planner takes on large models and clusters.

Plans, under the ``pipedream`` cost model, a 1,000-node chain, a ResNet-like DAG and a
wide branching DAG (Inception-like blocks) on 1,024 workers (flat, replicated, every
worker used; then with ``--fewer-workers``, a memory limit, and ``--straight`` on 64
workers), and a 100-node chain on a two-level topology of 16 servers of 8 GPUs
(PipeDream's hierarchical program costs the cube of the cuts, so it is for smaller
graphs). ``--quick``: 100 nodes on 64 workers.

Profiles are synthetic and seeded (compute 1-10 ms per node, parameters 0-40 MB,
activations 1-64 MB). The figures are the planner's own seconds: there is no anchor
here (PipeDream's optimizer is compared with it in ``planner_vs_pipedream``).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Table
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.optimizer import PlannerConfig, make_plan
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.topology import Topology

__all__ = ["CASE", "chain", "plan_timed", "residual_dag", "run", "wide_dag"]


def _layer(rng: random.Random, name: str) -> LayerProfile:
    return LayerProfile(
        name=name,
        forward_s=rng.uniform(0.3e-3, 3e-3),
        backward_s=rng.uniform(0.7e-3, 7e-3),
        output_bytes=rng.randint(1, 64) * 2**20,
        parameter_bytes=rng.choice([0, 0, rng.randint(1, 40) * 2**20]),
    )


def chain(num_nodes: int, seed: int = 0) -> Profile:
    """A sequence of ``num_nodes`` layers.

    Example:
        >>> chain(5).num_layers
        5
    """
    rng = random.Random(seed)
    return Profile(layers=tuple(_layer(rng, str(k)) for k in range(num_nodes)))


def residual_dag(num_nodes: int, seed: int = 0) -> Profile:
    """ResNet-like: blocks of a 3-node main path and an add, with a skip edge around it,
    and every fourth block a 1-node (downsampling) shortcut instead.

    Example:
        >>> residual_dag(10).num_layers
        10
    """
    rng = random.Random(seed)
    layers: list[LayerProfile] = []
    edges: list[tuple[int, int]] = []

    def add() -> int:
        layers.append(_layer(rng, f"n{len(layers)}"))
        return len(layers) - 1

    last = add()
    block = 0
    while len(layers) < num_nodes:
        start = last
        for _ in range(3):
            node = add()
            edges.append((last, node))
            last = node
        skip = start
        if block % 4 == 0:
            skip = add()
            edges.append((start, skip))
        join = add()
        edges.extend([(last, join), (skip, join)])
        last, block = join, block + 1
    return Profile(layers=tuple(layers), edges=tuple(edges))


def wide_dag(num_nodes: int, seed: int = 0, width: int = 3) -> Profile:
    """Blocks of a fork node, ``width`` parallel branches of 1-2 nodes, and a join node,
    repeated to about ``num_nodes`` nodes.

    Example:
        >>> wide_dag(20).num_layers >= 20
        True
    """
    rng = random.Random(seed)
    layers: list[LayerProfile] = []
    edges: list[tuple[int, int]] = []

    def add() -> int:
        layers.append(_layer(rng, f"n{len(layers)}"))
        return len(layers) - 1

    join = add()
    while len(layers) < num_nodes:
        fork = add()
        edges.append((join, fork))
        ends = []
        for _ in range(width):
            last = fork
            for _ in range(rng.randint(1, 2)):
                node = add()
                edges.append((last, node))
                last = node
            ends.append(last)
        join = add()
        edges.extend((end, join) for end in ends)
    return Profile(layers=tuple(layers), edges=tuple(edges))


def plan_timed(name: str, profile: Profile, config: PlannerConfig) -> dict[str, Any]:
    """Plan ``profile`` under PipeDream's cost model; the seconds it took and the plan's
    size.

    Example:
        >>> row = plan_timed("chain", chain(6), PlannerConfig(topology=Topology.flat(2, 1e10)))
        >>> row["nodes"], row["workers"]
        (6, 2)
    """
    if config.cost_model != "pipedream":  # the searches' speed, under PipeDream's model
        config = dataclasses.replace(config, cost_model="pipedream")
    started = time.perf_counter()
    plan = make_plan(profile, config)
    seconds = time.perf_counter() - started
    graph = CutGraph(profile, max_cuts=config.max_cuts)  # for the counts reported
    pairs = sum(len(graph.supersets(c)) for c in range(graph.num_cuts))
    return {"name": name, "nodes": profile.num_layers, "cuts": graph.num_cuts, "pairs": pairs,
            "topology": config.topology.describe(), "seconds": seconds,
            "stages": plan.num_stages, "workers": plan.workers_used,
            "time_per_step_s": plan.time_per_step}


def run(context: BenchContext) -> BenchResult:
    """Plan every graph and topology; one row each."""
    nodes, workers = (100, 64) if context.quick else (1000, 1024)
    flat = Topology.flat(workers, 10e9)
    line = chain(nodes)
    residual = residual_dag(nodes)
    dag = wide_dag(nodes)
    servers = max(2, workers // 64)
    two_level = Topology.from_lists([8, servers], [300e9, 25e9])
    jobs: list[tuple[str, Profile, PlannerConfig]] = [
        ("chain", line, PlannerConfig(topology=flat)),
        ("chain --fewer-workers", line, PlannerConfig(topology=flat, fewer_workers=True)),
        ("chain --memory 8e9", line, PlannerConfig(topology=flat, memory_limit=8e9)),
        ("chain --straight (64 workers)", line,
         PlannerConfig(topology=Topology.flat(64, 10e9), straight=True)),
        ("residual DAG (ResNet-like)", residual, PlannerConfig(topology=flat)),
        ("wide DAG (Inception-like)", dag, PlannerConfig(topology=flat)),
        ("wide DAG --fewer-workers", dag, PlannerConfig(topology=flat, fewer_workers=True)),
        ("wide DAG --straight (64 workers)", dag,
         PlannerConfig(topology=Topology.flat(64, 10e9), straight=True)),
        (f"chain of {nodes // 10}, two levels", chain(nodes // 10),
         PlannerConfig(topology=two_level)),
    ]
    rows = []
    for name, profile, config in jobs:
        row = plan_timed(name, profile, config)
        context.progress(f"{name}: {row['seconds']:.2f} s")
        rows.append(row)
    table = Table(
        title=f"Planner time, {nodes}-node graphs on {workers} workers (PipeDream's cost model)",
        columns=["graph and options", "nodes", "cuts", "cut pairs", "topology", "planner s",
                 "stages", "workers used", "predicted ms/step"],
        rows=[[r["name"], r["nodes"], r["cuts"], r["pairs"], r["topology"],
               round(r["seconds"], 2), r["stages"], r["workers"],
               round(r["time_per_step_s"] * 1e3, 4)] for r in rows],
        anchor="none: the planner's own time on synthetic seeded profiles (compute 1-10 ms "
               "per node, parameters 0-40 MB, activations 1-64 MB)",
        notes="PipeDream's hierarchical program costs the cube of the cuts, so the two-level "
              "topology plans a tenth of the nodes.",
        key="times")
    return BenchResult(tables=[table], data={"nodes": nodes, "workers": workers, "runs": rows})


CASE = Case(name="planner_speed", title="How long the planner takes on large graphs and clusters",
            run=run, quick_seconds=2, full_seconds=70)
