"""pipetrain's planner against PipeDream's optimizer on PipeDream's published profiles.

For AlexNet, VGG-16, ResNet-50 and GNMT (PipeDream's ``profiler/*/profiles/*/graph.txt``,
kept outside this repository), on 4 and 8 workers at 1e9 and 1e10 B/s (replicated and
straight) and on two-level topologies (4x4 at 1.25e9/1.25e9 B/s, 4x2 at 1e10/1.25e9
B/s), prints pipetrain's predicted time per step under ``--cost-model pipedream`` and its
stages, and, with ``--pipedream DIR`` (a checkout of msr-fiddle/pipedream whose
``optimizer/optimizer_graph_hierarchical.py`` runs), PipeDream's own predicted time,
computed live, and for one-level cases PipeDream's plan re-evaluated by pipetrain's
implementation of the same cost model::

    python benchmarks/planner_vs_pipedream.py --profiles ~/pipedream/profiler \\
        --pipedream ~/pipedream [--markdown]

``--profiles DIR`` is searched for ``alexnet/graph.txt`` etc. (at any depth). PipeDream is
run with ``--activation_compression_ratio 1`` (its transfer terms on, as its README's
commands do). Not a unit test; it takes about a minute.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipetrain.plan.costs import LevelContext
from pipetrain.plan.costs_pipedream import PipeDreamCostModel
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.optimizer import PlannerConfig, make_plan
from pipetrain.plan.pipedream_format import load_pipedream_graph
from pipetrain.plan.plan_file import Plan
from pipetrain.plan.profile import Profile
from pipetrain.plan.search import FlatSearch
from pipetrain.plan.topology import Topology

MODELS = ("alexnet", "vgg16", "resnet50", "gnmt")


@dataclass(frozen=True)
class Case:
    workers: tuple[int, ...]
    bandwidths: tuple[float, ...]
    straight: bool

    def label(self) -> str:
        counts = "x".join(str(w) for w in self.workers)
        bands = "/".join(f"{b:.3g}" for b in self.bandwidths)
        return f"{counts} @ {bands}{' straight' if self.straight else ''}"


CASES = [
    *(
        Case((w,), (b,), s)
        for s in (False, True)
        for w in (4, 8)
        for b in (1e9, 1e10)
    ),
    *(Case(w, b, s) for s in (False, True) for w, b in (((4, 4), (1.25e9, 1.25e9)), ((4, 2), (1e10, 1.25e9)))),
]


def find_profiles(root: Path) -> dict[str, Path]:
    found = {}
    for model in MODELS:
        hits = sorted(root.rglob(f"{model}/graph.txt"))
        if hits:
            found[model] = hits[0]
    return found


def run_pipedream(pipedream: Path, profile: Path, case: Case) -> tuple[float, str, str] | str:
    """PipeDream's predicted time, its stdout and its partitioned graph; or an error."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "optimizer_graph_hierarchical.py", "-f", str(profile.resolve()),
            "-n", *map(str, case.workers), "-b", *map(str, case.bandwidths),
            "--activation_compression_ratio", "1", "-o", out,
        ]
        if case.straight:
            command.append("--straight_pipeline")
        done = subprocess.run(
            command, cwd=pipedream / "optimizer", capture_output=True, text=True, timeout=3600
        )
        match = re.search(r"Time per stage in pipeline: (\S+)", done.stdout)
        if done.returncode != 0 or match is None or match.group(1) == "None":
            return f"PipeDream failed: {(done.stderr or done.stdout).strip()[-200:]}"
        total = 1
        for w in case.workers:
            total *= w
        graph = (Path(out) / f"gpus={total}.txt").read_text()
        return float(match.group(1)), done.stdout, graph


def pipedream_flat_time(profile: Profile, case: Case, stdout: str, graph_text: str) -> float:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, required=True)
    parser.add_argument("--pipedream", type=Path, help="a msr-fiddle/pipedream checkout")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    profiles = find_profiles(args.profiles)
    missing = [m for m in args.models if m not in profiles]
    if missing:
        print(f"no graph.txt for {missing} under {args.profiles}", file=sys.stderr)
        return 2
    header = ["model", "case", "pipetrain (s)", "PipeDream (s)", "PD plan, our model (s)",
              "ratio", "planner s", "pipetrain stages (node positions x replicas)"]
    rows = []
    worst = 0.0
    for model in args.models:
        profile = load_pipedream_graph(profiles[model])
        for case in CASES:
            started = time.perf_counter()
            plan = make_plan(profile, PlannerConfig(
                topology=Topology.from_lists(list(case.workers), list(case.bandwidths)),
                straight=case.straight,
                cost_model="pipedream",
            ))
            seconds = time.perf_counter() - started
            theirs, evaluated = "-", "-"
            ratio = "-"
            if args.pipedream is not None:
                result = run_pipedream(args.pipedream, profiles[model], case)
                if isinstance(result, str):
                    theirs = result
                else:
                    value, stdout, graph_text = result
                    theirs = f"{value:.6f}"
                    ratio = f"{plan.time_per_step / value:.4f}"
                    worst = max(worst, plan.time_per_step / value)
                    if len(case.workers) == 1:
                        evaluated = f"{pipedream_flat_time(profile, case, stdout, graph_text):.6f}"
            rows.append([model, case.label(), f"{plan.time_per_step:.6f}", theirs, evaluated,
                         ratio, f"{seconds:.2f}", describe(plan, profile)])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        for row in [header, *rows]:
            print("  ".join(row))
    if args.pipedream is not None:
        print(f"\nlargest pipetrain / PipeDream ratio: {worst:.6f} (<= 1: never worse)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
