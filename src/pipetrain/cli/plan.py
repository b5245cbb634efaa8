"""``pipetrain plan``: cut a profiled model into stages and replicas for a cluster."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipetrain.plan.cost_models import COST_MODEL_NAMES, DEFAULT_COST_MODEL
from pipetrain.plan.optimizer import make_plan
from pipetrain.plan.pipedream_format import parse_pipedream_graph
from pipetrain.plan.planner_config import PLANNED_SCHEDULES, PlannerConfig
from pipetrain.plan.profile import Profile
from pipetrain.plan.table import render_plan
from pipetrain.plan.topology import Topology

__all__ = ["add_parser", "load_profile", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``plan`` sub-command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="partition a profiled model into replicated stages for a cluster",
        description=(
            "Find the stages (sets of layers or graph nodes) and the workers of each "
            "stage that minimize the predicted time per step on a cluster, exactly, and "
            "print the plan; --out writes it for 'pipetrain train --plan'."
        ),
    )
    parser.add_argument(
        "--profile",
        required=True,
        metavar="FILE",
        help="a pipetrain profile (JSON) or a PipeDream profile (graph.txt)",
    )
    parser.add_argument(
        "--workers",
        required=True,
        type=int,
        nargs="+",
        metavar="N",
        help="workers; several values are topology levels, innermost first "
             "(8 4: 4 servers of 8 GPUs)",
    )
    parser.add_argument(
        "--bandwidth",
        required=True,
        type=float,
        nargs="+",
        metavar="B",
        help="bytes per second between the workers of each level, innermost first "
             "(300e9 25e9)",
    )
    parser.add_argument(
        "--memory",
        "--memory-per-worker",
        dest="memory",
        type=float,
        metavar="BYTES",
        help="memory per worker the plan must fit in (one-level topologies)",
    )
    parser.add_argument(
        "--straight", action="store_true", help="no replication: one worker per stage"
    )
    parser.add_argument(
        "--fewer-workers",
        action="store_true",
        help="may leave workers idle when that is faster (default: use them all)",
    )
    parser.add_argument(
        "--cost-model",
        default=None,
        metavar="NAME",
        help=f"one of {', '.join(COST_MODEL_NAMES)} (default: {DEFAULT_COST_MODEL} on one-level "
             "topologies, which it plans with the schedule, micro-batches and checkpoint mode; "
             "pipedream, PipeDream's hierarchical planner, on several levels)",
    )
    parser.add_argument(
        "--schedule",
        nargs="+",
        metavar="NAME",
        help=f"pipetrain cost model: the schedules to choose from (default: "
             f"{', '.join(PLANNED_SCHEDULES)})",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        nargs="+",
        metavar="M",
        help="pipetrain cost model: micro-batches of each replica of the first stage to choose "
             "from, as `pipetrain train --microbatches` counts them (a step runs M times the "
             "first stage's replicas; default: every count of micro-batches per step that "
             "divides the profile's batch size, up to 64)",
    )
    parser.add_argument(
        "--checkpoint",
        nargs="+",
        metavar="MODE",
        help="pipetrain cost model: checkpoint modes to choose from (never, except_last, "
             "always, per_layer, per-stage: each stage the fastest mode that fits; default: "
             "never, and under --memory all but per_layer, which per-stage may choose)",
    )
    parser.add_argument(
        "--fsdp-policies",
        nargs="+",
        metavar="POLICY",
        help="pipetrain cost model, under --memory: where the FSDP plans gather and reduce, "
             "to choose from: gathered (parameters gathered once per step, gradients "
             "reduce-scattered once: pipetrain train --fsdp), reduce-each "
             "(--fsdp-reduce-each-microbatch), reshard (--fsdp-reshard), lean (both), or "
             "all; default gathered",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--out", metavar="FILE", help="also write the plan file here")
    parser.set_defaults(run=run)
    return parser


def _policies(names: list[str] | None) -> tuple[str, ...]:
    """``--fsdp-policies`` as PlannerConfig takes it (``all``: every policy; none given:
    the default)."""
    from pipetrain.plan.costs_pipetrain import FSDP_POLICIES

    if not names:
        return ("gathered",)
    return tuple(FSDP_POLICIES) if names == ["all"] else tuple(names)


def load_profile(path: str) -> Profile:
    """A pipetrain JSON profile or a PipeDream ``graph.txt``, told apart by content."""
    with open(path, encoding="utf-8") as file:
        text = file.read()
    if text.lstrip().startswith("{"):
        profile = Profile.from_json(text)
        if "path" not in profile.metadata:
            profile.metadata["path"] = path
        return profile
    return parse_pipedream_graph(text, name=path)


def run(args: argparse.Namespace) -> int:
    """Run ``pipetrain plan``; 2 on bad input (message on stderr)."""
    try:
        profile = load_profile(args.profile)
    except OSError as error:
        return _fail(f"cannot read --profile {args.profile!r}: {error.strerror or error}")
    except ValueError as error:
        return _fail(f"--profile {args.profile!r}: {error}")
    if profile.is_sequence:
        from pipetrain.cli.profile import profile_warnings

        for warning in profile_warnings(profile):
            if not warning.startswith("load average"):  # measured then, not now
                sys.stderr.write(f"pipetrain plan: warning: the profile's {warning}: its plan "
                                 "may cut badly; fix: profile again on a quiet machine\n")
    try:
        topology = Topology.from_lists(
            args.workers, args.bandwidth, spell=("--workers", "--bandwidth")
        )
        config = PlannerConfig(
            topology=topology,
            cost_model=_cost_model(args, topology),
            memory_limit=args.memory,
            straight=args.straight,
            fewer_workers=args.fewer_workers,
            schedules=tuple(args.schedule) if args.schedule else None,
            num_microbatches=tuple(args.microbatches) if args.microbatches else None,
            checkpoints=tuple(args.checkpoint) if args.checkpoint else None,
            fsdp_policies=_policies(args.fsdp_policies),
        )
        plan = make_plan(profile, config, progress=_progress)
    except ValueError as error:
        return _fail(str(error))
    if args.out:
        try:
            plan.save(args.out)
        except OSError as error:
            return _fail(f"cannot write --out {args.out!r}: {error.strerror or error}")
    if args.json:
        sys.stdout.write(json.dumps(plan.to_dict()) + "\n")
        return 0
    where = profile.metadata.get("path") or args.profile
    sys.stdout.write(
        f"plan for {where} ({profile.num_layers} {'layers' if profile.is_sequence else 'nodes'}) "
        f"on {topology.describe()}\n\n"
        + render_plan(plan)
        + (f"\nplan written to {args.out}" if args.out else "")
        + "\n"
    )
    return 0


def _cost_model(args: argparse.Namespace, topology: Topology) -> str:
    """``--cost-model``, or the default for the topology: the pipetrain cost model plans
    one-level topologies; several levels go to PipeDream's hierarchical planner (said on
    stderr), unless a pipetrain-only choice was asked for (then the planner names it)."""
    if args.cost_model is not None:
        return str(args.cost_model)
    chose = args.schedule or args.microbatches or args.checkpoint
    if topology.num_levels > 1 and not chose:
        sys.stderr.write(
            f"pipetrain plan: note: {topology.num_levels} levels of workers: planned with the "
            "pipedream cost model (PipeDream's hierarchical planner; the pipetrain cost model "
            "plans one level)\n")
        return "pipedream"
    return DEFAULT_COST_MODEL


def _progress(line: str) -> None:
    """A long search's progress, every few seconds, on stderr (stdout keeps the plan)."""
    sys.stderr.write(f"pipetrain plan: {line}\n")
    sys.stderr.flush()


def _fail(message: str) -> int:
    sys.stderr.write(f"pipetrain plan: error: {message}\n")
    return 2
