"""``pipetrain simulate``: generate a schedule, simulate it, print the grid or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipetrain.schedule import (
    ASYNC_SCHEDULES,
    SCHEDULE_NAMES,
    Costs,
    build_schedule,
    canonical_name,
    render_grid,
    render_timeline,
    simulate,
)
from pipetrain.schedule.async_stream import AsyncStream
from pipetrain.schedule.steady_state import steady_state, window_time

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
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help=f"steps of M micro-batches for the asynchronous schedules ({', '.join(ASYNC_SCHEDULES)}; "
             "default 4): they stream without flushes, and the figures show their steady state",
    )
    parser.add_argument("--vertical-sync", action="store_true",
                        help="pipedream: every stage uses the input stage's weight version")
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
                ("--steps", args.steps),
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
        asynchronous = name in ASYNC_SCHEDULES
        if not asynchronous and (args.steps is not None or args.vertical_sync):
            raise ValueError(f"--steps and --vertical-sync are for {', '.join(ASYNC_SCHEDULES)}, "
                             f"not {name}")
        steps = (4 if args.steps is None else args.steps) if asynchronous else 1
        schedule = build_schedule(
            name,
            num_ranks=args.stages,
            num_microbatches=args.microbatches,
            stages_per_rank=virtual,
            communication=False,
            **({"num_steps": steps, "vertical_sync": args.vertical_sync} if asynchronous else {}),
        )
        result = simulate(schedule, costs)
        steady = _steady(schedule, result, costs, args) if asynchronous else None
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
        if steady is not None:
            data.update(steps=steps, vertical_sync=args.vertical_sync, **steady)
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
    if steady is not None:
        sys.stdout.write(
            f"steady state: one micro-batch every {steady['steady_per_microbatch']:g} "
            f"({steps} steps of {args.microbatches} without flushes: "
            f"{steady['average_per_microbatch']:g} per micro-batch, fill and drain included); "
            f"1f1b with a flush every {args.microbatches} micro-batches: "
            f"{steady['one_f_one_b_per_microbatch']:g} per micro-batch "
            f"({steady['speedup_over_1f1b']:.2f}x). Pipeline.train_step ends each step on "
            f"every rank together: {steady['per_microbatch_in_steps']:g} per micro-batch "
            f"({steady['one_f_one_b_per_microbatch'] / steady['per_microbatch_in_steps']:.2f}x "
            "1f1b).\n"
        )
    return 0


def _steady(schedule: Any, result: Any, costs: Costs, args: argparse.Namespace) -> dict[str, float]:
    """The steady state of an asynchronous run, and 1F1B's cost per micro-batch."""
    state = steady_state(schedule, result.timeline)
    flushed = simulate(build_schedule("1f1b", num_ranks=args.stages,
                                      num_microbatches=args.microbatches, communication=False),
                       costs)
    per_microbatch = flushed.makespan / args.microbatches
    stream = AsyncStream(schedule.name, [1] * args.stages, vertical_sync=args.vertical_sync)
    return {"steady_per_microbatch": state.steady, "average_per_microbatch": state.average,
            "one_f_one_b_per_microbatch": per_microbatch,
            "speedup_over_1f1b": state.speedup_over(per_microbatch),
            "per_microbatch_in_steps": window_time(stream, args.microbatches, costs)}
