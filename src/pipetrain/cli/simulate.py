"""``pipetrain simulate``: generate a schedule, simulate it, print the grid or JSON.

Stages are priced by the layers of the model they hold (:func:`~pipetrain.schedule.costs.model_costs`):
``--cost`` prices one rank's share of the model, so every schedule of ``--stages K``
ranks runs the same model, and a stage of a schedule with two stages per rank costs half
as much as a stage of 1F1B. The model has ``--layers`` equal layers (default: one per
stage); the output says what was assumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from pipetrain.counts import count_of
from pipetrain.schedule import (
    ASYNC_SCHEDULES,
    SCHEDULE_NAMES,
    Costs,
    Schedule,
    add_fsdp_actions,
    build_schedule,
    canonical_name,
    default_stages_per_rank,
    fsdp_policy_costs,
    load_schedule,
    render_grid,
    render_timeline,
    simulate,
    validate,
)
from pipetrain.schedule.async_stream import AsyncStream
from pipetrain.schedule.costs import LAYER_COSTS, even_layers, model_costs
from pipetrain.schedule.jitter import Jitter, execute_order
from pipetrain.schedule.memory import (
    ActivationPeaks,
    StageBytes,
    activation_peaks,
    offload_budgets,
    stage_budgets,
    stage_modes,
)
from pipetrain.schedule.readiness import ORDERS
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
        metavar="NAME|FILE",
        help=f"one of {', '.join(SCHEDULE_NAMES)} (or an alias such as pipedream-flush), or "
             "a schedule file (one rank per line, as print(schedule) writes it)",
    )
    parser.add_argument(
        "--stages", type=int, metavar="K", help="number of ranks (pipeline depth; with a name)"
    )
    parser.add_argument(
        "--microbatches", type=int, metavar="M", help="micro-batches per step (with a name)"
    )
    parser.add_argument(
        "--virtual",
        type=int,
        metavar="V",
        help="stages per rank (interleaved-1f1b, looped-bfs: default 2; zb-v, dualpipe-v: 2)",
    )
    parser.add_argument(
        "--cost",
        default="",
        metavar="SPEC",
        help="per-action costs of one rank's share of the model (1/K of it; a stage holding "
             "part of that share costs its part): forward, backward, backward_input, "
             "backward_weight, communication (a message's latency), send (how long posting a "
             "message keeps the sender busy), reduce, step, unshard (--fsdp); e.g. "
             "forward=1,backward=2,"
             "communication=0.1,send=0.05 (default forward=1, backward 2, I and W 1 each); "
             "per stage, taken as given: forward=1:1:2",
    )
    parser.add_argument(
        "--layers", type=int, metavar="L",
        help="the model's equal layers, cut as evenly as whole layers allow into the "
             "schedule's stages, which are priced by the layers they hold (default: one "
             "layer per stage)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help=f"steps of M micro-batches for the asynchronous schedules ({', '.join(ASYNC_SCHEDULES)}; "
             "default 4): they stream without flushes, and the figures show their steady state",
    )
    parser.add_argument(
        "--activations", metavar="SAVED[:INPUT]",
        help="bytes one layer saves for its backward per micro-batch (and a stage's input "
             "per micro-batch, default 0; a layer's input under per_layer): the peak activation bytes of every rank and stage "
             "are reported, under --checkpoint and --offload; e.g. --activations 6.4e7:4e6",
    )
    parser.add_argument(
        "--checkpoint", default="never", metavar="MODE[,MODE...]",
        help="with --activations: each stage's mode (never, except_last, always, per_layer; "
             "one for all or one per stage); default never",
    )
    parser.add_argument(
        "--offload", default=None, metavar="BYTES[,BYTES...]",
        help="with --activations: bytes each stage keeps on its device, the rest offloaded "
             "('none': a stage keeps all)",
    )
    parser.add_argument(
        "--jitter", metavar="SPEC",
        help="also play the schedule with seeded random slow-downs, in its fixed order and "
             "readiness-driven (a rank runs a later action whose input is in while its next "
             "one waits): delay (each compute action of the slowed ranks takes up to 1 + delay "
             "times its cost), ranks (colon-separated; default all), link (extra latency of "
             "their messages), seed; e.g. --jitter delay=0.4,ranks=1,seed=0",
    )
    parser.add_argument(
        "--fsdp", action="store_true",
        help="the stages' parameters are FSDP-sharded over replicas: each step gathers a "
             "stage's parameters (UNSHARD, an all-gather priced by the cost unshard, one "
             "compute action ahead), reduce-scatters its gradients (REDUCE, cost reduce) and "
             "frees the gathered copy (RESHARD) before its optimizer STEP (cost step); e.g. "
             "--fsdp --cost unshard=0.5,reduce=0.5",
    )
    parser.add_argument(
        "--fsdp-reshard", action="store_true",
        help="with --fsdp: each forward and each backward gathers its stage's parameters "
             "(the cost unshard, in line) and frees them after, as --fsdp-reshard of "
             "pipetrain train does: no UNSHARD / RESHARD actions",
    )
    parser.add_argument(
        "--fsdp-reduce-each-microbatch", action="store_true",
        help="with --fsdp: each backward reduce-scatters the gradients it made (the cost "
             "reduce, in line), as in pipetrain train; REDUCE then costs nothing",
    )
    parser.add_argument("--vertical-sync", action="store_true",
                        help="pipedream: every stage uses the input stage's weight version")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the timeline to a PNG")
    parser.set_defaults(run=run)
    return parser


def _schedule(args: argparse.Namespace) -> Schedule:
    """The schedule to simulate: generated by name, or read from a file (and the
    options it fixes: ``--stages``, ``--microbatches``, ``--virtual``)."""
    from pipetrain.api.user_schedule import is_schedule_file

    if is_schedule_file(args.schedule):
        if args.fsdp:
            raise ValueError("--fsdp lowers a schedule by name; a schedule file runs as "
                             "written (write its UNSHARD, REDUCE and RESHARD actions in it)")
        schedule = load_schedule(args.schedule)
        validate(schedule)
        args.stages, args.microbatches = schedule.num_ranks, schedule.num_microbatches
        return schedule
    name = canonical_name(args.schedule)
    missing = [flag for flag, value in (("--stages", args.stages),
                                        ("--microbatches", args.microbatches)) if value is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} needed with schedule {name!r} (a schedule "
                         f"file sets them); e.g. --stages 4 --microbatches 8")
    asynchronous = name in ASYNC_SCHEDULES
    if not asynchronous and (args.steps is not None or args.vertical_sync):
        raise ValueError(f"--steps and --vertical-sync are for {', '.join(ASYNC_SCHEDULES)}, "
                         f"not {name}")
    policy = [flag for flag, on in (("--fsdp-reshard", args.fsdp_reshard),
                                    ("--fsdp-reduce-each-microbatch",
                                     args.fsdp_reduce_each_microbatch)) if on]
    if policy and not args.fsdp:
        raise ValueError(f"{' and '.join(policy)} {'sets' if len(policy) == 1 else 'set'} "
                         "where the FSDP stages gather and reduce; add --fsdp")
    if args.fsdp and (asynchronous or name == "forward"):
        raise ValueError(f"--fsdp is for the synchronous training schedules, not {name} (FSDP "
                         "gathers and reduces once per step: there is no such step)")
    steps = (4 if args.steps is None else args.steps) if asynchronous else 1
    schedule = build_schedule(
        name,
        num_ranks=args.stages,
        num_microbatches=args.microbatches,
        stages_per_rank=default_stages_per_rank(name) if args.virtual is None else args.virtual,
        communication=False,
        optimizer_step=args.fsdp,
        reduce=args.fsdp,
        **({"num_steps": steps, "vertical_sync": args.vertical_sync} if asynchronous else {}),
    )
    return add_fsdp_actions(schedule) if args.fsdp and not args.fsdp_reshard else schedule


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
                ("--layers", args.layers),
            )
            if value is not None and value < 1
        ]
        if bad:
            raise ValueError("; ".join(bad))
        given = Costs.parse(args.cost)
        schedule = _schedule(args)
        name, virtual = schedule.name, schedule.num_stages // schedule.num_ranks
        stage_layers = _stage_layers(schedule, args.layers)
        costs = model_costs(given, num_ranks=schedule.num_ranks, stage_layers=stage_layers)
        if args.fsdp:
            costs = fsdp_policy_costs(costs, schedule.num_stages,
                                      reshard_after_forward=args.fsdp_reshard,
                                      reduce_each_microbatch=args.fsdp_reduce_each_microbatch)
        result = simulate(schedule, costs)
        steady = _steady(schedule, result, costs, args) if name in ASYNC_SCHEDULES else None
        memory = _memory(schedule, stage_layers, args)
        jittered = _jittered(schedule, costs, args.jitter) if args.jitter else None
        steps = 4 if args.steps is None else args.steps  # of an asynchronous schedule
    except (OSError, ValueError) as error:
        sys.stderr.write(f"pipetrain simulate: error: {in_flags(str(error))}\n")
        return 2
    if args.plot:
        title = f"{name}: {count_of(args.stages, 'rank')}, {count_of(args.microbatches, 'micro-batch')}"
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
            "costs": given.to_dict(),
            "layers": sum(stage_layers),
            "stage_layers": list(stage_layers),
            "stage_costs": dataclasses.asdict(costs.per_stage(schedule.num_stages)),
            **result.to_dict(timeline=False),
        }
        if steady is not None:
            data.update(steps=steps, vertical_sync=args.vertical_sync, **steady)
        if jittered is not None:
            data["jitter"] = jittered
        if memory is not None:
            data.update(activation_bytes_per_rank=list(memory.per_rank),
                        activation_bytes_per_stage=list(memory.per_stage))
        sys.stdout.write(json.dumps(data) + "\n")
        return 0
    peaks = ", ".join(str(p) for p in result.peak_activations)
    sys.stdout.write(
        render_grid(schedule)
        + "\n\n"
        + f"{name} on {count_of(args.stages, 'rank')} ({count_of(schedule.num_stages, 'stage')}), "
        f"{count_of(args.microbatches, 'micro-batch')}: makespan {result.makespan:g}, bubble "
        f"{result.bubble_fraction:.1%} of all ranks' time (idle per rank: "
        f"{', '.join(f'{i:g}' for i in result.idle)}), peak activations per rank: {peaks} "
        f"(micro-batches held between F and their last backward). The grid shows one "
        f"column per action at unit cost; the figures assume "
        f"{pricing(args.cost, costs, schedule.num_ranks, stage_layers)}."
        + (f" Timeline written to {args.plot}." if args.plot else "")
        + "\n"
    )
    if memory is not None:
        sys.stdout.write(
            f"peak activation bytes per rank: {', '.join(f'{b:.4g}' for b in memory.per_rank)}; "
            f"per stage: {', '.join(f'{b:.4g}' for b in memory.per_stage)} (checkpoint "
            f"{args.checkpoint}" + (f", offload {args.offload}" if args.offload else "") + ")\n")
    if jittered is not None:
        sys.stdout.write(
            f"under jitter {args.jitter}: makespan {jittered['fixed_makespan']:g} in the fixed "
            f"order, {jittered['ready_makespan']:g} readiness-driven "
            f"({jittered['fixed_makespan'] / jittered['ready_makespan']:.3f}x)\n")
    if steady is not None:
        sys.stdout.write(
            f"steady state (a long run): one micro-batch every {steady['steady_per_microbatch']:g}; "
            f"the {steps} step{'s' if steps != 1 else ''} of {args.microbatches} above, without "
            f"flushes: {steady['average_per_microbatch']:g} per micro-batch, fill and drain "
            "included; "
            f"1f1b with a flush every {count_of(args.microbatches, 'micro-batch')}: "
            f"{steady['one_f_one_b_per_microbatch']:g} per micro-batch "
            f"({steady['speedup_over_1f1b']:.2f}x). Pipeline.train_step ends each step on "
            f"every rank together: {steady['per_microbatch_in_steps']:g} per micro-batch "
            f"({steady['one_f_one_b_per_microbatch'] / steady['per_microbatch_in_steps']:.2f}x "
            "1f1b).\n"
        )
    return 0


def _jittered(schedule: Schedule, costs: Costs, spec: str) -> dict[str, Any]:
    """Makespans of ``schedule`` under the jitter ``spec`` in both execution orders."""
    if schedule.name in ASYNC_SCHEDULES:
        raise ValueError(f"--jitter plays synchronous schedules; {schedule.name} streams "
                         "without flushes (drop --jitter)")
    jitter = Jitter.parse(spec)
    stage_costs = costs.per_stage(schedule.num_stages)
    makespans = {order: max((t.end for t in execute_order(
        schedule, stage_costs, order=order, jitter=jitter).timeline), default=0.0)
        for order in ORDERS}
    return {"spec": dataclasses.asdict(jitter), **{f"{o}_makespan": m for o, m in makespans.items()}}


def _memory(schedule: Schedule, stage_layers: tuple[int, ...],
            args: argparse.Namespace) -> ActivationPeaks | None:
    """The peak activation bytes under ``--activations``, ``--checkpoint`` and ``--offload``
    (None without ``--activations``)."""
    if args.activations is None:
        if args.checkpoint != "never" or args.offload is not None:
            raise ValueError("--checkpoint and --offload price memory: give --activations too, "
                             "e.g. --activations 6.4e7")
        return None
    saved, _, given_input = args.activations.partition(":")
    try:
        per_layer, per_input = float(saved), float(given_input or 0)
    except ValueError:
        raise ValueError(f"--activations {args.activations}: not SAVED[:INPUT] in bytes; fix: "
                         "e.g. --activations 6.4e7:4e6") from None
    count = schedule.num_stages
    modes = stage_modes(args.checkpoint, count)
    if "selective" in modes:
        raise ValueError("--checkpoint selective: the simulator has no figure for what a "
                         "selective stage keeps; fix: never, except_last, always or per_layer")
    offload = stage_budgets(offload_budgets(args.offload), count, unit=1)
    stages = [StageBytes(saved=per_layer * n, input=per_input, layer_inputs=per_input * n,
                         layer_saved=per_layer) for n in stage_layers]
    return activation_peaks(schedule, stages, modes=modes, offload=offload)


def _stage_layers(schedule: Schedule, layers: int | None) -> tuple[int, ...]:
    """The model's layers on each stage: ``--layers`` cut evenly, or one per stage."""
    if layers is None:
        return (1,) * schedule.num_stages
    if layers < schedule.num_stages:
        raise ValueError(
            f"--layers {layers} cannot fill the {schedule.num_stages} stages of "
            f"{schedule.name} on {count_of(schedule.num_ranks, 'rank')} (each stage holds at "
            f"least one layer); fix: --layers {schedule.num_stages} or more")
    return even_layers(layers, schedule.num_stages)


def pricing(cost: str, costs: Costs, num_ranks: int, stage_layers: tuple[int, ...]) -> str:
    """What the simulation assumed about the model and its costs, in words (``cost``:
    ``--cost`` as given; ``costs``: the per-stage costs it made).

    Example:
        >>> stage_layers = (1,) * 8
        >>> pricing("", model_costs(Costs(), num_ranks=4, stage_layers=stage_layers), 4,
        ...         stage_layers)
        'a model of 8 equal layers, 1 per stage, whose share per rank (1/4) costs forward=1, backward=2 (I and W 1 each); a stage: forward 0.5, backward 1; no communication latency'
    """
    num_layers = sum(stage_layers)
    placed = (f"{stage_layers[0]} per stage" if len(set(stage_layers)) == 1
              else "per stage " + ", ".join(map(str, stage_layers)))
    stage = costs.per_stage(len(stage_layers))

    def span(values: tuple[float, ...]) -> str:
        return f"{min(values):g}" if min(values) == max(values) else \
            f"{min(values):g} to {max(values):g}"

    text = (f"a model of {count_of(num_layers, 'equal layer')}, {placed}, whose share per rank "
            f"(1/{num_ranks}) costs {cost or 'forward=1, backward=2 (I and W 1 each)'}")
    if any(isinstance(getattr(Costs.parse(cost), name), tuple) for name in LAYER_COSTS):
        text += " (costs given per stage are taken as they are)"
    text += f"; a stage: forward {span(stage.forward)}, backward {span(stage.backward)}"
    if not any(stage.communication) and not any(stage.send):
        text += "; no communication latency"
    return text


_LONG_RUN = 8
"""Steps of the run whose middle gives an asynchronous schedule's steady state."""

_FLAGS = (("stages_per_rank", "--virtual"), ("num_microbatches", "--microbatches"),
          ("num_ranks", "--stages"), ("num_steps", "--steps"))


def in_flags(text: str) -> str:
    """A schedule error written with this command's flags instead of Python names.

    Example:
        >>> in_flags("zb-h1 has one stage per rank, got stages_per_rank=2; use stages_per_rank=1")
        'zb-h1 has one stage per rank, got --virtual 2; use --virtual 1'
        >>> in_flags("needs num_microbatches >= 3")
        'needs --microbatches >= 3'
    """
    for name, option in _FLAGS:
        text = re.sub(rf"\b{name}=", f"{option} ", text)
        text = re.sub(rf"\b{name}\b", option, text)
    return text


def _steady(schedule: Any, result: Any, costs: Costs, args: argparse.Namespace) -> dict[str, float]:
    """The steady state of an asynchronous schedule (the middle of a long run, whatever
    ``--steps``), this run's average, and 1F1B's cost per micro-batch."""
    steps = schedule.num_microbatches // args.microbatches
    if steps < _LONG_RUN:
        virtual = schedule.num_stages // schedule.num_ranks
        long_run = build_schedule(schedule.name, num_ranks=args.stages,
                                  num_microbatches=args.microbatches, stages_per_rank=virtual,
                                  communication=False, num_steps=_LONG_RUN,
                                  vertical_sync=args.vertical_sync)
        state = steady_state(long_run, simulate(long_run, costs).timeline)
    else:
        state = steady_state(schedule, result.timeline)
    state = dataclasses.replace(state, average=result.makespan / schedule.num_microbatches)
    flushed = simulate(build_schedule("1f1b", num_ranks=args.stages,
                                      num_microbatches=args.microbatches, communication=False),
                       costs)
    per_microbatch = flushed.makespan / args.microbatches
    stream = AsyncStream(schedule.name, [1] * args.stages, vertical_sync=args.vertical_sync)
    return {"steady_per_microbatch": state.steady, "average_per_microbatch": state.average,
            "one_f_one_b_per_microbatch": per_microbatch,
            "speedup_over_1f1b": state.speedup_over(per_microbatch),
            "per_microbatch_in_steps": window_time(stream, args.microbatches, costs)}
