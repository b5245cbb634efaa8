"""Which layout a ``pipetrain train`` run trains with: the even split, ``--balance``
(layers per stage, or ``auto``: profile the model and let the planner cut it), or
``--plan FILE`` (a plan of ``pipetrain plan``: stages, replicas per stage, and the
schedule choices of its cost model).

With ``--plan`` the run has as many workers as the plan uses; the plan's schedule,
micro-batch count and checkpoint mode apply unless those options are given. With
``--balance auto``, rank 0 profiles the model on its own device at the run's
micro-batch size, plans ``--stages`` stages (``--replicas`` replicas each) with the
planner's ``pipetrain`` cost model, writes ``profile.json`` and ``plan.json`` into the
run folder, and every rank trains with that cut.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from pipetrain.cli.train_options import flag, pipeline_fields, stages_per_rank

__all__ = ["AUTO", "layout_problems", "num_workers", "parse_balance", "run_config"]

AUTO = "auto"
_PLAN_SETS = ("stages", "replicas", "virtual")
_PLAN_CHOOSES = {"schedule": "schedule", "microbatches": "num_microbatches",
                 "checkpoint": "checkpoint"}


def parse_balance(text: str) -> list[int]:
    """``"3,1,2"`` -> ``[3, 1, 2]``.

    Raises:
        ValueError: not a comma-separated list of positive integers.

    Example:
        >>> parse_balance("3, 1,2")
        [3, 1, 2]
    """
    try:
        balance = [int(part) for part in text.split(",")]
    except ValueError:
        balance = []
    if not balance or any(n < 1 for n in balance):
        raise ValueError(
            f"--balance {text!r} must be 'auto' or layers per stage, e.g. --balance 3,3"
        )
    return balance


def _plan(args: argparse.Namespace) -> Any:
    from pipetrain.plan import Plan

    return Plan.load(args.plan)


def num_workers(args: argparse.Namespace) -> int:
    """The processes the run needs."""
    if args.plan is not None:
        return int(_plan(args).workers_used)
    return int(args.stages * args.replicas)


def layout_problems(args: argparse.Namespace) -> list[str]:
    """Every problem with ``--balance`` / ``--plan`` (flags named)."""
    from pipetrain.api.plan_config import config_from_plan

    problems: list[str] = []
    if getattr(args, "model", "gpt") != "gpt":
        from pipetrain.cli.hf_models import hf_layout_problems

        return hf_layout_problems(args)
    num_layers = args.layers + 2
    if args.plan is not None:
        if args.balance is not None:
            problems.append("--plan and --balance both cut the model; fix: keep one of them")
        given = [f"--{name}" for name in _PLAN_SETS if name in args.given]
        if given:
            problems.append(f"--plan sets the stages and replicas; fix: leave out {', '.join(given)}")
        if not os.path.isfile(args.plan):
            return [*problems, f"--plan {args.plan!r}: no such file"]
        try:
            config = config_from_plan(args.plan, num_layers=num_layers, **_chosen(args))
        except (OSError, ValueError, KeyError, TypeError) as error:
            return [*problems, f"--plan {args.plan!r}: {error}"]
        if args.batch_size < config.total_microbatches:
            problems.append(
                f"--batch-size {args.batch_size} cannot fill the {config.total_microbatches} "
                f"micro-batches of the plan's step ({config.num_microbatches} per replica of "
                f"its first stage); fix: --batch-size {config.total_microbatches} or "
                f"{flag('num_microbatches', max(1, args.batch_size // config.replica_counts[0]))}"
            )
        return problems
    if args.balance is not None and args.balance != AUTO:
        try:
            balance = parse_balance(args.balance)
        except ValueError as error:
            return [str(error)]
        stages = args.stages * stages_per_rank(args)
        if len(balance) != stages or sum(balance) != num_layers:
            problems.append(
                f"--balance {args.balance} gives {len(balance)} stages of {sum(balance)} layers, "
                f"but the run has {stages} stages and {num_layers} layers (embedding, "
                f"{args.layers} blocks, head); fix: {len(balance)} numbers adding up to "
                f"{num_layers}, or {flag('num_stages', len(balance))}"
            )
    return problems


def _chosen(args: argparse.Namespace) -> dict[str, Any]:
    """The fields the options set when the run follows a plan (the plan's choices of
    schedule, micro-batches and checkpoint apply unless those options are given)."""
    fields = pipeline_fields(args)
    for name in ("num_stages", "replicas", "stages_per_rank"):
        fields.pop(name)
    for option, field in _PLAN_CHOOSES.items():
        if option not in args.given:
            fields.pop(field)
    return fields


def run_config(args: argparse.Namespace, *, balance: list[int] | None = None) -> Any:
    """The :class:`~pipetrain.api.config.PipelineConfig` of the run (``balance``: the cut
    ``--balance auto`` found)."""
    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.plan_config import config_from_plan

    if args.plan is not None:
        return config_from_plan(args.plan, num_layers=args.layers + 2, **_chosen(args))
    if balance is None and args.balance not in (None, AUTO):
        balance = parse_balance(args.balance)
    return PipelineConfig(**pipeline_fields(args), balance=balance)
