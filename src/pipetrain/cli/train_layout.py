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

import os
import re
from typing import Any

from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.train_options import flag, pipeline_fields, stages_per_rank

__all__ = [
    "AUTO",
    "even_balance",
    "layout_problems",
    "num_workers",
    "parse_balance",
    "run_config",
    "stage_count_problem",
    "virtual_needed",
]

AUTO = "auto"
_PLAN_SETS = ("stages", "replicas", "virtual")
_PLAN_CHOOSES = {"schedule": "schedule", "microbatches": "num_microbatches",
                 "checkpoint": "checkpoint"}


def parse_balance(text: str) -> list[int]:
    """``"3,1,2"`` -> ``[3, 1, 2]``.

    Raises:
        ValueError: not a comma-separated list of positive integers (the message names
            the entries that are not).

    Example:
        >>> parse_balance("3, 1,2")
        [3, 1, 2]
        >>> parse_balance("0,4")
        Traceback (most recent call last):
        ...
        ValueError: --balance '0,4' must be 'auto' or layers per stage, each at least 1: stage 0 gets 0
    """
    parts = [part.strip() for part in text.split(",")]
    bad = [part for part in parts if not re.fullmatch(r"[+-]?\d+", part)]
    if bad:
        raise ValueError(f"--balance {text!r} must be 'auto' or layers per stage, whole numbers "
                         f"separated by commas: {', '.join(repr(part) for part in bad)} "
                         f"{'is' if len(bad) == 1 else 'are'} not")
    balance = [int(part) for part in parts]
    empty = [(j, n) for j, n in enumerate(balance) if n < 1]
    if empty:
        raise ValueError(f"--balance {text!r} must be 'auto' or layers per stage, each at least "
                         f"1: {', '.join(f'stage {j} gets {n}' for j, n in empty)}")
    return balance


def even_balance(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage as even as possible (the first stages take one more).

    Example:
        >>> even_balance(6, 2), even_balance(7, 3)
        ([3, 3], [3, 2, 2])
    """
    share, extra = divmod(num_layers, num_stages)
    return [share + (j < extra) for j in range(num_stages)]


def _balance_problems(args: RunConfig) -> list[str]:
    """What is wrong with ``--balance N,N,...`` for this run, with a fix that fits it."""
    assert args.balance is not None
    num_layers = args.layers + 2
    virtual = virtual_needed(args)  # a wrong --virtual is a problem of its own
    stages = args.stages * virtual
    model = f"{num_layers} layers (embedding, {args.layers} blocks, head)"
    example = ""
    if stages <= num_layers:
        example = f"--balance {','.join(map(str, even_balance(num_layers, stages)))}"
    try:
        balance = parse_balance(args.balance)
    except ValueError as error:
        fix = (f"{example} ({stages} stages of the run's {num_layers} layers: embedding, "
               f"{args.layers} blocks, head) or --balance auto" if example else "--balance auto")
        return [f"{error}; fix: {fix}"]
    if len(balance) == stages and sum(balance) == num_layers:
        return []
    fixes = []
    if example:
        fixes.append(f"{stages} numbers adding up to {num_layers}, e.g. {example}")
    if sum(balance) == num_layers and len(balance) % virtual == 0:
        fixes.append(flag("num_stages", len(balance) // virtual)
                     + (f" (with --virtual {virtual}: {len(balance)} stages)" if virtual > 1 else ""))
    elif len(balance) == stages and sum(balance) >= 3 and args.resume is None:
        fixes.append(f"--layers {sum(balance) - 2} (a model of {sum(balance)} layers)")
    return [
        f"--balance {args.balance} gives {len(balance)} stage{'s' * (len(balance) != 1)} of "
        f"{sum(balance)} layers, but the "
        f"run has {stages} stages and {model}; fix: {', or '.join(fixes) or '--balance auto'}"
    ]


def _virtual_range(args: RunConfig) -> tuple[int, int | None]:
    """The stages per rank ``--schedule`` takes (least, most; None: no most)."""
    from pipetrain.schedule import canonical_name, stages_per_rank_range

    try:
        return stages_per_rank_range(canonical_name(args.schedule))
    except ValueError:  # a schedule file or an unknown name: --virtual as given
        return 1, None


def virtual_needed(args: RunConfig) -> int:
    """``--virtual`` (or its default), or the nearest count ``--schedule`` takes.

    Example:
        >>> virtual_needed(RunConfig(schedule="zb-v", virtual=3))
        2
    """
    given = stages_per_rank(args)
    least, most = _virtual_range(args)
    return max(given, least) if most is None else min(max(given, least), most)


def stage_count_problem(args: RunConfig) -> str | None:
    """More model stages (``--stages`` x stages per rank) than the model has layers, with
    fixes the run can take: stages per rank counted as the schedule needs them (a wrong
    ``--virtual`` is its own problem, named by the configuration's check), and each fix a
    layout the schedule runs.

    Example:
        >>> args = RunConfig(layers=2, stages=3, virtual=3, schedule="zb-v",
        ...                           resume=None, plan=None)
        >>> print(stage_count_problem(args))
        more stages than layers: --schedule zb-v runs 2 stages per rank (not --virtual 3), so --stages 3 makes 6 stages for 4 layers (embedding, 2 blocks, head); fix: --virtual 2 --stages 2, or --virtual 2 --layers 4
    """
    if args.plan is not None:
        return None
    num_layers = args.layers + 2
    given = stages_per_rank(args)
    least, most = _virtual_range(args)
    virtual = virtual_needed(args)
    stages = args.stages * virtual
    if stages <= num_layers:
        return None
    model = f"{num_layers} layers (embedding, {args.layers} blocks, head)"
    fixed = f"--virtual {virtual} " if virtual != given else ""
    fixes = []
    if num_layers // virtual >= 1:
        fixes.append(f"{fixed}--stages {num_layers // virtual}")
    if most is None and virtual > least and num_layers // args.stages >= least:
        fixes.append(f"--virtual {num_layers // args.stages}")
    if args.resume is None:
        fixes.append(f"{fixed}--layers {stages - 2}")
    if virtual != given:
        why = (f"--schedule {args.schedule} runs {virtual} stages per rank (not --virtual "
               f"{given}), so --stages {args.stages} makes {stages} stages")
    else:
        why = (f"{stages} stages" if virtual == 1 else
               f"--stages {args.stages} x --virtual {virtual} = {stages} stages")
    return (f"more stages than layers: {why} for {model}; fix: "
            f"{', or '.join(fixes) or 'a new run with more --layers'}")


def num_workers(args: RunConfig) -> int:
    """The processes the run needs (a plan's: as many as it uses)."""
    return args.num_workers


def _tensor_parallel_problems(args: RunConfig) -> list[str]:
    """What ``--tensor-parallel T > 1`` needs: pipetrain's GPT (the one model with a plan,
    :mod:`pipetrain.models.gpt_tp`), its heads and width divisible by T, no dropout, no
    ``--plan``."""
    tp = args.tensor_parallel
    if tp == 1:
        return (["--sequence-parallel splits positions over the tensor-parallel ranks, and "
                 "--tensor-parallel is 1; fix: --tensor-parallel 2 (or more), or leave out "
                 "--sequence-parallel"] if args.sequence_parallel else [])
    if args.model != "gpt":
        return [f"--tensor-parallel {tp} splits pipetrain's GPT only (its plan: "
                f"pipetrain.models.gpt_tp); --model {args.model!r} has none; fix: "
                "--tensor-parallel 1, or the Python API with your plan "
                "(Pipeline(..., tensor_parallel_plan=...), docs/mesh.md)"]
    problems = []
    if args.heads % tp or args.width % tp:
        problems.append(f"--tensor-parallel {tp} splits the GPT's heads and width, and --heads "
                        f"{args.heads} / --width {args.width} do not divide by {tp}; fix: "
                        "--tensor-parallel 2 with an even --heads and --width")
    if args.dropout > 0:
        problems.append(f"--dropout {args.dropout} with --tensor-parallel {tp}: a rank's heads "
                        "would draw other attention dropout masks than one process; fix: "
                        "--dropout 0 or --tensor-parallel 1")
    if args.plan is not None:
        problems.append(f"--plan with --tensor-parallel {tp}: a plan places stages and replicas "
                        "only; fix: --stages and --replicas instead of --plan, or "
                        "--tensor-parallel 1")
    return problems


def layout_problems(args: RunConfig) -> list[str]:
    """Every problem with ``--balance`` / ``--plan`` (flags named)."""
    from pipetrain.api.plan_config import config_from_plan

    problems: list[str] = _tensor_parallel_problems(args)
    if problems:
        return problems
    if args.model != "gpt":
        from pipetrain.cli.hf_models import HF_MODELS, hf_layout_problems
        from pipetrain.cli.user_models import is_user_model, user_model_problems

        if args.model in HF_MODELS:
            return hf_layout_problems(args)
        if is_user_model(args.model):
            return user_model_problems(args)
        return [f"--model {args.model!r} is not gpt, hf-gpt2, hf-llama, a FILE.py:FUNCTION that "
                "builds your model, or a Hugging Face model folder; fix: one of those "
                "(see docs/user-models.md)"]
    num_layers = args.layers + 2
    if args.plan is not None:
        if args.given("balance"):
            problems.append("--plan and --balance both cut the model; fix: keep one of them")
        given = [f"--{name}" for name in _PLAN_SETS if args.given(name)]
        if given:
            problems.append(f"--plan sets the stages and replicas; fix: leave out {', '.join(given)}")
        if not os.path.isfile(args.plan):
            return [*problems, f"--plan {args.plan!r}: no such file"]
        try:
            config = config_from_plan(args.plan, num_layers=num_layers, model=model_identity(args),
                                      **_chosen(args))
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
        problems += _balance_problems(args)
    return problems


def _chosen(args: RunConfig) -> dict[str, Any]:
    """The fields the options set when the run follows a plan (the plan's choices of
    schedule, micro-batches and checkpoint apply unless those options are given)."""
    fields = pipeline_fields(args)
    for name in ("num_stages", "replicas", "stages_per_rank"):
        fields.pop(name)
    for option, field in _PLAN_CHOOSES.items():
        if not args.given(option):
            fields.pop(field)
    return fields


def model_identity(args: RunConfig) -> dict[str, Any]:
    """The identity of the run's GPT (what a plan's profile must describe), built on the
    meta device."""
    from pipetrain.cli.train_options import gpt_config
    from pipetrain.models import gpt_layer_factories
    from pipetrain.plan.profiler import identify_model

    return identify_model(gpt_layer_factories(gpt_config(args), seed=args.seed), name="gpt")


def run_config(args: RunConfig, *, balance: list[int] | None = None) -> Any:
    """The :class:`~pipetrain.api.config.PipelineConfig` of the resolved run (a plan's
    layout is in it already; ``balance``: the cut ``--balance auto`` found)."""
    from pipetrain.api.config import PipelineConfig

    if balance is None and args.balance is not None and args.balance != AUTO:
        balance = parse_balance(args.balance)
    fields = pipeline_fields(args)
    if args.stage_replicas is not None:
        fields |= {"replicas": 1, "stage_replicas": tuple(args.stage_replicas)}
    return PipelineConfig(**fields, balance=balance)
