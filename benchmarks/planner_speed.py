"""How long the planner takes on large models and clusters (prints seconds; not a test).

Plans, under the ``pipedream`` cost model, a 1,000-node chain, a ResNet-like DAG and a
wide branching DAG (Inception-like blocks) on 1,024 workers (flat, replicated, every worker used; then
with ``--fewer-workers``, a memory limit, and ``--straight`` on 64 workers), and a
100-node chain on a two-level topology of 16 servers of 8 GPUs (PipeDream's
hierarchical program costs the cube of the cuts, so it is for smaller graphs)::

    python benchmarks/planner_speed.py [--nodes 1000] [--workers 1024] [--quick]

Profiles are synthetic and seeded (compute 1-10 ms per node, parameters 0-40 MB,
activations 1-64 MB). ``--quick`` shrinks everything for a smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

from pipetrain.plan.graph import CutGraph
from pipetrain.plan.optimizer import PlannerConfig, make_plan
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.topology import Topology


def _layer(rng: random.Random, name: str) -> LayerProfile:
    return LayerProfile(
        name=name,
        forward_s=rng.uniform(0.3e-3, 3e-3),
        backward_s=rng.uniform(0.7e-3, 7e-3),
        output_bytes=rng.randint(1, 64) * 2**20,
        parameter_bytes=rng.choice([0, 0, rng.randint(1, 40) * 2**20]),
    )


def chain(num_nodes: int, seed: int = 0) -> Profile:
    """A sequence of ``num_nodes`` layers."""
    rng = random.Random(seed)
    return Profile(layers=tuple(_layer(rng, str(k)) for k in range(num_nodes)))


def residual_dag(num_nodes: int, seed: int = 0) -> Profile:
    """ResNet-like: blocks of a 3-node main path and an add, with a skip edge around it,
    and every fourth block a 1-node (downsampling) shortcut instead."""
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
    repeated to about ``num_nodes`` nodes."""
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


def run(name: str, profile: Profile, config: PlannerConfig) -> None:
    if config.cost_model != "pipedream":  # the searches' speed, under PipeDream's model
        config = dataclasses.replace(config, cost_model="pipedream")
    started = time.perf_counter()
    plan = make_plan(profile, config)
    seconds = time.perf_counter() - started
    graph = CutGraph(profile, max_cuts=config.max_cuts)  # for the counts printed
    pairs = sum(len(graph.supersets(c)) for c in range(graph.num_cuts))
    print(
        f"{name:<44} {profile.num_layers:>5} nodes {graph.num_cuts:>6} cuts {pairs:>9} pairs "
        f"{config.topology.describe():<32} {seconds:7.2f} s   {plan.num_stages:>3} stages, "
        f"{plan.workers_used} workers, {plan.time_per_step * 1e3:.4f} ms/step",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    nodes, workers = (100, 64) if args.quick else (args.nodes, args.workers)
    flat = Topology.flat(workers, 10e9)
    line = chain(nodes)
    residual = residual_dag(nodes)
    dag = wide_dag(nodes)
    run("chain", line, PlannerConfig(topology=flat))
    run("chain --fewer-workers", line, PlannerConfig(topology=flat, fewer_workers=True))
    run("chain --memory 8e9", line, PlannerConfig(topology=flat, memory_limit=8e9))
    run("chain --straight (64 workers)", line,
        PlannerConfig(topology=Topology.flat(64, 10e9), straight=True))
    run("residual DAG (ResNet-like)", residual, PlannerConfig(topology=flat))
    run("wide DAG (Inception-like)", dag, PlannerConfig(topology=flat))
    run("wide DAG --fewer-workers", dag, PlannerConfig(topology=flat, fewer_workers=True))
    run("wide DAG --straight (64 workers)", dag,
        PlannerConfig(topology=Topology.flat(64, 10e9), straight=True))
    servers = max(2, workers // 64)
    two_level = Topology.from_lists([8, servers], [300e9, 25e9])
    run(f"chain of {nodes // 10}, two levels", chain(nodes // 10),
        PlannerConfig(topology=two_level))


if __name__ == "__main__":
    main()
