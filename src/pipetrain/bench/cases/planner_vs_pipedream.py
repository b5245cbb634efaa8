"""Case ``planner_vs_pipedream``: pipetrain's planner against PipeDream's optimizer on PipeDream's published profiles.

For AlexNet, VGG-16, ResNet-50 and GNMT (PipeDream's ``profiler/*/profiles/*/graph.txt``,
found by :func:`~pipetrain.bench.cases.pipedream_traffic.find_profiles`: the package's
``bench/data/pipedream``, ``$PIPETRAIN_PIPEDREAM_PROFILES`` or ``shared/pipedream`` beside
a checkout; the case is skipped without them), on 4 and 8 workers at 1e9 and 1e10 B/s
(replicated and straight) and on two-level topologies (4x4 at 1.25e9/1.25e9 B/s, 4x2 at
1e10/1.25e9 B/s): pipetrain's predicted time per step under ``--cost-model pipedream``,
its stages and how long it planned. With ``$PIPETRAIN_PIPEDREAM_CHECKOUT`` naming a
checkout of msr-fiddle/pipedream whose ``optimizer/optimizer_graph_hierarchical.py`` runs
under this Python, PipeDream's own predicted time, computed live in the same run, and for
one-level cases PipeDream's plan re-evaluated by pipetrain's implementation of the same
cost model. PipeDream is run with ``--activation_compression_ratio 1`` (its transfer
terms on, as its README's commands do). ``--quick``: the one-level cases only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, SkipCase, Table
from pipetrain.bench.drawings import bars, find_table
from pipetrain.plan.costs import LevelContext
from pipetrain.plan.costs_pipedream import PipeDreamCostModel
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.optimizer import PlannerConfig, make_plan
from pipetrain.plan.pipedream_format import load_pipedream_graph
from pipetrain.plan.plan_file import Plan
from pipetrain.plan.profile import Profile
from pipetrain.plan.search import FlatSearch
from pipetrain.plan.topology import Topology

__all__ = ["CASE", "CHECKOUT_ENV", "CLUSTERS", "MODELS", "Cluster", "describe", "draw",
           "pipedream_flat_time", "run", "run_pipedream"]

MODELS = ("alexnet", "vgg16", "resnet50", "gnmt")
CHECKOUT_ENV = "PIPETRAIN_PIPEDREAM_CHECKOUT"
"""Environment variable naming a msr-fiddle/pipedream checkout (PipeDream's optimizer)."""


@dataclass(frozen=True)
class Cluster:
    """Workers per topology level (innermost first), their bandwidths, straight or not."""

    workers: tuple[int, ...]
    bandwidths: tuple[float, ...]
    straight: bool

    def label(self) -> str:
        """The cluster in a table cell.

        Example:
            >>> Cluster((4, 2), (1e10, 1.25e9), True).label()
            '4x2 @ 1e+10/1.25e+09 straight'
        """
        counts = "x".join(str(w) for w in self.workers)
        bands = "/".join(f"{b:.3g}" for b in self.bandwidths)
        return f"{counts} @ {bands}{' straight' if self.straight else ''}"


CLUSTERS = [
    *(
        Cluster((w,), (b,), s)
        for s in (False, True)
        for w in (4, 8)
        for b in (1e9, 1e10)
    ),
    *(Cluster(w, b, s) for s in (False, True)
      for w, b in (((4, 4), (1.25e9, 1.25e9)), ((4, 2), (1e10, 1.25e9)))),
]


def run_pipedream(pipedream: Path, profile: Path, case: Cluster) -> tuple[float, str, str] | str:
    """PipeDream's predicted time, its stdout and its partitioned graph; or an error."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "optimizer_graph_hierarchical.py", "-f", str(profile.resolve()),
            "-n", *map(str, case.workers), "-b", *map(str, case.bandwidths),
            "--activation_compression_ratio", "1", "-o", out,
        ]
        if case.straight:
            command.append("--straight_pipeline")
        env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
        done = subprocess.run(
            command, cwd=pipedream / "optimizer", capture_output=True, text=True, timeout=3600,
            env=env,
        )
        match = re.search(r"Time per stage in pipeline: (\S+)", done.stdout)
        if done.returncode != 0 or match is None or match.group(1) == "None":
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            return f"PipeDream failed: {lines[-1][-200:]}"
        total = 1
        for w in case.workers:
            total *= w
        graph = (Path(out) / f"gpus={total}.txt").read_text()
        return float(match.group(1)), done.stdout, graph


def pipedream_flat_time(profile: Profile, case: Cluster, stdout: str, graph_text: str) -> float:
    """PipeDream's one-level plan evaluated by pipetrain's PipeDream cost model."""
    names = {layer.name: k for k, layer in enumerate(profile.layers)}
    stage_of: dict[int, int] = {}
    for line in graph_text.splitlines():
        m = re.match(r"(\S+) -- .* -- stage_id=(\d+)$", line.strip())
        if m and m.group(1) in names:
            stage_of[names[m.group(1)]] = int(m.group(2))
    block = stdout.split("Level 1")[-1]
    replicas = [int(r) for r in re.findall(r"^\(\d+, \d+\) \S+ (\d+)$", block, re.MULTILINE)]
    graph = CutGraph(profile)
    index = {mask: k for k, mask in enumerate(graph.cuts)}
    stages, mask, start = [], 0, 0
    for j, r in enumerate(replicas):
        mask |= sum(1 << v for v, s in stage_of.items() if s == j)
        stages.append((start, index[mask], r))
        start = index[mask]
    search = FlatSearch(
        graph, model=PipeDreamCostModel(), level=LevelContext(bandwidth=case.bandwidths[0]),
        num_workers=case.workers[0],
    )
    return search.bottleneck(stages)


def describe(plan: Plan, profile: Profile) -> str:
    """Each stage as ``first-last`` node positions (in the profile's topological order;
    ``N of first-last`` when the stage skips some), times its replicas per level."""
    parts = []
    for indices, stage in zip(plan.layer_indices(profile), plan.stages):
        first, last = indices[0], indices[-1]
        if len(indices) == 1:
            span = f"{first}"
        elif last - first + 1 == len(indices):
            span = f"{first}-{last}"
        else:
            span = f"{len(indices)} of {first}-{last}"
        per = "x".join(map(str, stage.replicas_per_level))
        parts.append(f"[{span}]x{per}")
    return " ".join(parts)


def _compare(model: str, path: Path, case: Cluster, pipedream: Path | None) -> dict[str, Any]:
    """One model on one cluster: pipetrain's plan, and PipeDream's where it runs."""
    profile = load_pipedream_graph(path)
    started = time.perf_counter()
    plan = make_plan(profile, PlannerConfig(
        topology=Topology.from_lists(list(case.workers), list(case.bandwidths)),
        straight=case.straight,
        cost_model="pipedream",
    ))
    row: dict[str, Any] = {"model": model, "case": case.label(),
                           "pipetrain_s": plan.time_per_step,
                           "planner_seconds": time.perf_counter() - started,
                           "stages": describe(plan, profile), "pipedream_s": None,
                           "pipedream_plan_our_model_s": None, "ratio": None,
                           "pipedream_error": None}
    if pipedream is None:
        return row
    result = run_pipedream(pipedream, path, case)
    if isinstance(result, str):
        row["pipedream_error"] = result
        return row
    value, stdout, graph_text = result
    row["pipedream_s"] = value
    row["ratio"] = plan.time_per_step / value
    if len(case.workers) == 1:
        row["pipedream_plan_our_model_s"] = pipedream_flat_time(profile, case, stdout,
                                                                graph_text)
    return row


def _cell(value: float | None, digits: int = 6) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run(context: BenchContext) -> BenchResult:
    """Plan every model on every cluster (and run PipeDream's optimizer where given)."""
    from pipetrain.bench.cases.pipedream_traffic import find_profiles, shown_folder

    folder = find_profiles(MODELS)
    if folder is None:
        raise SkipCase("PipeDream's published profiles (<model>/graph.txt for "
                       f"{', '.join(MODELS)}) are neither in the package's bench/data/pipedream "
                       "nor in shared/pipedream beside the checkout; set "
                       "PIPETRAIN_PIPEDREAM_PROFILES to a folder holding them")
    checkout = os.environ.get(CHECKOUT_ENV)
    pipedream = Path(checkout) if checkout else None
    missing = [f"{name}/" for name in ("optimizer", "graph")
               if pipedream is not None and not (pipedream / name).is_dir()]
    if missing:  # the optimizer imports the checkout's graph package
        raise ValueError(f"{CHECKOUT_ENV}={checkout!r} has no {' or '.join(missing)} folder; "
                         "give a whole checkout of https://github.com/msr-fiddle/pipedream")
    clusters = [c for c in CLUSTERS if len(c.workers) == 1] if context.quick else CLUSTERS
    rows: list[dict[str, Any]] = []
    for model in MODELS:
        context.progress(f"{model}: {len(clusters)} clusters"
                         + (", PipeDream's optimizer too" if pipedream else ""))
        rows.extend(_compare(model, folder / model / "graph.txt", c, pipedream)
                    for c in clusters)
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    notes = ("Times are seconds per minibatch; stages are node positions in the profile's "
             "topological order (N of a-b: N nodes between a and b) times replicas per level. "
             "Planner seconds depend on the machine's load.")
    if pipedream is None:
        notes += (f" PipeDream's optimizer was not run (set {CHECKOUT_ENV} to a "
                  "msr-fiddle/pipedream checkout whose optimizer runs under this Python; it "
                  "imports graphviz and renders with its dot program).")
    else:
        notes += (f" Largest pipetrain / PipeDream ratio: {max(ratios):.6f} (at most 1: "
                  "never worse)." if ratios else " PipeDream's optimizer failed on every case.")
    table = Table(
        title="pipetrain's planner vs PipeDream's optimizer on PipeDream's published profiles "
              "(--cost-model pipedream)",
        columns=["model", "cluster", "pipetrain s", "PipeDream s",
                 "PipeDream's plan, pipetrain's model s", "pipetrain / PipeDream",
                 "planner s", "pipetrain's stages"],
        rows=[[r["model"], r["case"], _cell(r["pipetrain_s"]),
               r["pipedream_error"] or _cell(r["pipedream_s"]),
               _cell(r["pipedream_plan_our_model_s"]), _cell(r["ratio"], 4),
               round(r["planner_seconds"], 2), r["stages"]] for r in rows],
        anchor="PipeDream's optimizer_graph_hierarchical.py run live on the same profile and "
               "cluster (where a checkout is given), and its plan re-evaluated by pipetrain's "
               "PipeDream cost model",
        notes=notes, key="plans")
    return BenchResult(tables=[table], data={
        "profiles": shown_folder(folder),
        "pipedream_checkout": f"${CHECKOUT_ENV}" if checkout else None, "rows": rows})


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """pipetrain's predicted step over PipeDream's per model and cluster (both on
    PipeDream's cost model; at most 1: never worse): one PNG, none when PipeDream's
    optimizer was not run (no ratio in the table).

    Example::

        draw(tables, data, Path("results"))  # ['planner_vs_pipedream_ratio.png'] or []
    """
    return bars(out / "planner_vs_pipedream_ratio.png", find_table(tables, "plans"),
                ["model", "cluster"], {"pipetrain / PipeDream": "pipetrain / PipeDream"},
                form="{} {}", title="pipetrain's planner over PipeDream's optimizer: "
                "predicted step per model and cluster (at most 1: never worse)",
                ylabel="predicted step ratio", reference=1.0)


CASE = Case(name="planner_vs_pipedream",
            title="The planner vs PipeDream's optimizer on PipeDream's profiles",
            run=run, draw=draw, quick_seconds=5, full_seconds=60)
