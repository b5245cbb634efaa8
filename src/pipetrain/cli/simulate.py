"""``pipetrain simulate``: generate a schedule, simulate it, print the grid or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipetrain.schedule import (
    SCHEDULE_NAMES,
    Costs,
    build_schedule,
    canonical_name,
    render_grid,
    render_timeline,
    simulate,
)

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``simulate`` sub-command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="simulate a pipeline schedule: grid, bubble, peak activations",
        description=(
            "Generate a pipeline schedule, validate it, and simulate it under per-action "
            "costs: makespan, bubble fraction, peak activations per rank."
        ),
    )
    parser.add_argument(
        "--schedule",
        required=True,
        metavar="NAME",
        help=f"one of {', '.join(SCHEDULE_NAMES)} (or an alias such as pipedream-flush)",
    )
    parser.add_argument(
        "--stages", required=True, type=int, metavar="K", help="number of ranks (pipeline depth)"
    )
    parser.add_argument(
        "--microbatches", required=True, type=int, metavar="M", help="micro-batches per step"
    )
    parser.add_argument(
        "--virtual",
        type=int,
        metavar="V",
        help="stages per rank (interleaved-1f1b: default 2; forward: default 1)",
    )
    parser.add_argument(
        "--cost",
        default="",
        metavar="SPEC",
        help="per-action costs: forward, backward, backward_input, backward_weight, "
             "communication (a message's latency), send (how long posting a message keeps "
             "the sender busy), reduce, step; e.g. forward=1,backward=2,communication=0.1,"
             "send=0.05; per stage: forward=1:1:2",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the timeline to a PNG")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``pipetrain simulate``; 2 on bad input (message on stderr)."""
    try:
        bad = [
            f"{flag} must be at least 1, got {value}"
            for flag, value in (
                ("--stages", args.stages),
                ("--microbatches", args.microbatches),
                ("--virtual", args.virtual),
            )
            if value is not None and value < 1
        ]
        if bad:
            raise ValueError("; ".join(bad))
        name = canonical_name(args.schedule)
        virtual = args.virtual
        if virtual is None:
            virtual = 2 if name == "interleaved-1f1b" else 1
        costs = Costs.parse(args.cost)
        schedule = build_schedule(
            name,
            num_ranks=args.stages,
            num_microbatches=args.microbatches,
            stages_per_rank=virtual,
            communication=False,
        )
        result = simulate(schedule, costs)
    except ValueError as error:
        sys.stderr.write(f"pipetrain simulate: error: {error}\n")
        return 2
    if args.plot:
        title = f"{name}: {args.stages} ranks, {args.microbatches} micro-batches"
        try:
            render_timeline(result.timeline, args.plot, title=title)
        except (OSError, ValueError) as error:
            sys.stderr.write(
                f"pipetrain simulate: error: cannot write --plot {args.plot!r}: {error}\n"
            )
            return 2
    if args.json:
        data = {
            "schedule": name,
            "stages": args.stages,
            "microbatches": args.microbatches,
            "virtual": virtual,
            "num_stages": schedule.num_stages,
            "costs": costs.to_dict(),
            **result.to_dict(timeline=False),
        }
        sys.stdout.write(json.dumps(data) + "\n")
        return 0
    peaks = ", ".join(str(p) for p in result.peak_activations)
    sys.stdout.write(
        render_grid(schedule)
        + "\n\n"
        + f"{name} on {args.stages} ranks ({schedule.num_stages} stages), "
        f"{args.microbatches} micro-batches: makespan {result.makespan:g}, bubble "
        f"{result.bubble_fraction:.1%} of all ranks' time (idle per rank: "
        f"{', '.join(f'{i:g}' for i in result.idle)}), peak activations per rank: {peaks} "
        f"(micro-batches held between F and their last backward). The grid shows one "
        f"column per action at unit cost; the figures use the costs "
        f"{args.cost or 'forward=1 (backward 2, I and W 1 each)'}."
        + (f" Timeline written to {args.plot}." if args.plot else "")
        + "\n"
    )
    return 0
