"""The options of ``pipetrain train``: their definitions, which ones the user gave, and
the configurations they make.

Every option records, when it is given on the command line, its name in
``args.given``: a resumed run takes the options the user did not give from the run it
continues (:mod:`.train_resume`), and honours (and records) the ones given.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

from pipetrain.api.lr_schedule import LR_SCHEDULES
from pipetrain.api.optimizers import OPTIMIZERS
from pipetrain.cli.run_config import RunConfig
from pipetrain.runtime.host_memory import HOST_MEMORY
from pipetrain.schedule.memory import offload_budgets

__all__ = [
    "FLAGS",
    "MODEL_OPTIONS",
    "RUN_OPTIONS",
    "add_train_arguments",
    "asynchronous",
    "flag",
    "gpt_config",
    "pipeline_config",
    "pipeline_fields",
    "recorded",
    "stages_per_rank",
]

MODEL_OPTIONS = ("model", "layers", "width", "heads", "context", "optimizer")
"""Options that fix the shape of the model's weights and of the optimizer's state: a
resume cannot change them."""
RUN_OPTIONS = ("out", "resume")
"""Options of this invocation alone: never taken from a resumed run."""

FLAGS = {
    "num_stages": "--stages",
    "replicas": "--replicas",
    "num_microbatches": "--microbatches",
    "schedule": "--schedule",
    "stages_per_rank": "--virtual",
    "checkpoint": "--checkpoint",
    "offload": "--offload",
    "clip_grad_norm": "--clip",
    "seed": "--seed",
    "timeout": "--timeout",
    "nonfinite": "--nonfinite",
    "mixed_precision": "--precision",
    "num_layers": "--layers",
    "width": "--width",
    "num_heads": "--heads",
    "context": "--context",
    "dropout": "--dropout",
    "vertical_sync": "--vertical-sync",
    "data_parallel": "--fsdp",
    "tensor_parallel": "--tensor-parallel",
    "reshard_after_forward": "--fsdp-reshard",
    "reduce_each_microbatch": "--fsdp-reduce-each-microbatch",
}
"""The command-line flag of each configuration field (PipelineConfig, GPTConfig)."""


def flag(name: str, value: Any) -> str:
    """A setting as the command line spells it: ``flag("stages_per_rank", 2) == "--virtual 2"``.

    Example:
        >>> flag("num_stages", 4), flag("batch_size", 8)
        ('--stages 4', '--batch-size 8')
    """
    option = FLAGS.get(name, "--" + name.replace("_", "-"))
    if name == "data_parallel":  # --fsdp on or off
        return option if value == "fsdp" else f"without {option}"
    if isinstance(value, bool):  # an on/off flag
        return option if value else f"without {option}"
    return f"{option} {value}"


class _Given(argparse.Action):
    """Store the value and remember that the option was given."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = set(getattr(namespace, "given", ())) | {self.dest}


class _GivenFlag(_Given):
    """An on/off flag: True when given (and remembered as given)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["nargs"] = 0
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, True, option_string)


def _number(kind: Callable[[str], Any], *, low: float, strict: bool, what: str,
            high: float | None = None, why: str = "") -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if value < low or (strict and value == low):
            bound = f"above {low:g}" if strict else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        if high is not None and value > high:
            shown = f"{int(high):,}" if float(high).is_integer() and high < 1e15 else f"{high:g}"
            raise argparse.ArgumentTypeError(f"must be at most {shown} ({why}), got {text}")
        return value

    return convert


_positive_int = _number(int, low=1, strict=False, what="a positive integer")
_count = _number(int, low=0, strict=False, what="an integer")
_positive = _number(float, low=0.0, strict=True, what="a number")
_non_negative = _number(float, low=0.0, strict=False, what="a number")
_learning_rate = _number(float, low=0.0, strict=True, what="a number", high=3.4e38,
                         why="the largest float32: the optimizers compute in float32")
_sample_bytes = _number(int, low=0, strict=False, what="an integer", high=1_000_000,
                        why="each byte runs the whole model once; "
                            "`pipetrain sample` samples more from the checkpoint")


def _trackers(text: str) -> str:
    from pipetrain.cli.trackers import tracker_problem

    problem = tracker_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem.split(": ", 1)[1])
    return text


_beta = _number(float, low=0.0, strict=False, what="a number", high=0.999999,
                why="a decay rate below 1")


def _rate(text: str) -> float:
    value = _non_negative(text)
    if not value < 1.0:
        raise argparse.ArgumentTypeError(f"must be below 1, got {text}")
    return float(value)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``pipetrain train`` option to ``parser``."""
    from pipetrain.schedule import TRAINING_SCHEDULES

    parser.set_defaults(given=set())

    def add(group: Any, name: str, **kwargs: Any) -> None:
        group.add_argument(name, action=_Given, **kwargs)

    layout = parser.add_argument_group("pipeline")
    add(layout, "--stages", type=_positive_int, default=2, help="pipeline ranks K (default 2)")
    add(layout, "--replicas", type=_positive_int, default=1, help="data-parallel replicas D (default 1)")
    add(layout, "--microbatches", type=_positive_int, default=8,
        help="micro-batches M of each replica (of the first stage, with a plan) in a step: "
             "its --batch-size / --replicas sequences cut into M (default 8)")
    add(layout, "--schedule", default="1f1b", metavar="NAME|FILE",
        help=f"{', '.join(TRAINING_SCHEDULES)} (default 1f1b), or a schedule file (one rank "
             "per line, as print(schedule) writes it; it sets --stages, --virtual and "
             "--microbatches unless given); pipedream and 2bw are asynchronous (no flush; "
             "docs/asynchronous.md): they train the GPT with untied embeddings, without "
             "--clip, and never skip a step")
    layout.add_argument("--vertical-sync", action=_GivenFlag, default=False,
                        help="pipedream: every stage runs a micro-batch with the weight version "
                             "the first stage used for it")
    layout.add_argument("--compile", action=_GivenFlag, default=False,
                        help="compile each layer of every stage with torch.compile (the first "
                             "step compiles; needs a C++ compiler on the CPU)")
    layout.add_argument("--fsdp", action=_GivenFlag, default=False,
                        help="the --replicas shard each stage's parameters, gradients and "
                             "optimizer state (FSDP2) instead of holding whole copies "
                             "(docs/mesh.md)")
    layout.add_argument("--fsdp-reshard", action=_GivenFlag, default=False,
                        help="--fsdp: free the gathered parameters after each forward and "
                             "gather them again for its backward (less memory, more traffic)")
    layout.add_argument("--fsdp-reduce-each-microbatch", action=_GivenFlag, default=False,
                        help="--fsdp: reduce-scatter each micro-batch's gradients after its "
                             "backward, so that no worker holds a whole gradient (less "
                             "memory, one reduce-scatter per micro-batch)")
    add(layout, "--tensor-parallel", type=_positive_int, default=1,
        help="tensor-parallel ranks T of each stage and replica (default 1): pipetrain's "
             "GPT's heads and MLP split over T workers (docs/mesh.md); --stages x --replicas "
             "x T workers in all")
    layout.add_argument("--sequence-parallel", action=_GivenFlag, default=False,
                        help="--tensor-parallel: also split each block's norms and residual "
                             "stream over the T workers by sequence position (the norms' "
                             "saved activations shrink by T; one all-gather more per block)")
    add(layout, "--virtual", type=_positive_int, default=None,
        help="stages per rank: interleaved-1f1b and looped-bfs (default 2); zb-v and "
             "dualpipe-v place exactly 2")
    add(layout, "--checkpoint", default="never", metavar="MODE[,MODE...]",
        help="what each stage does with its activations (default never): always, "
             "except_last or never (re-materialize all, all but the last, none of its "
             "micro-batches), selective (keep matrix products, recompute the rest) or "
             "per_layer (keep each layer's input, rebuild one layer at a time); one "
             "mode for all stages or one per model stage, e.g. always,selective,never,never")
    add(layout, "--offload", default=None, metavar="MIB[,MIB...]",
        help="MiB of saved activations each stage keeps on its device, the rest moved to "
             "host memory until its backward (0: all; on the CPU nothing moves); one budget "
             "for all stages or one per model stage, 'none' for a stage that keeps all")
    add(layout, "--balance", default=None, metavar="auto|N,N,...",
        help="layers per stage (embedding, blocks and head count as layers), or 'auto': "
             "profile the model and let the planner cut it (default: even split)")
    add(layout, "--plan", default=None, metavar="FILE",
        help="run a plan of `pipetrain plan` (its stages, replicas per stage and, when it "
             "chose them, schedule, micro-batches and checkpoint mode)")
    training = parser.add_argument_group("training")
    add(training, "--steps", type=_positive_int, default=1000,
        help="train up to this step (default 1000; with --resume, the total to reach)")
    add(training, "--batch-size", type=_positive_int, default=32, help="sequences per step (default 32)")
    add(training, "--accumulate", type=_positive_int, default=1,
        help="accumulate the gradients of N batches in each optimizer step: a step trains "
             "N x --batch-size sequences in N x --microbatches micro-batches (default 1)")
    add(training, "--lr", type=_learning_rate, default=1e-2, help="peak learning rate (default 1e-2)")
    add(training, "--warmup", type=_count, default=50, help="linear warm-up steps (default 50)")
    add(training, "--lr-schedule", default="cosine", choices=LR_SCHEDULES,
        help="after the warm-up: cosine (default) or linear down to --min-lr at --steps, "
             "constant, or wsd (stable, then linear down to --min-lr over the last 20%% of "
             "the steps)")
    add(training, "--min-lr", type=_non_negative, default=None,
        help="the learning rate the schedule ends at (default: --lr / 10)")
    add(training, "--optimizer", default="adamw", choices=OPTIMIZERS,
        help="adamw (default), adam, sgd (with --momentum) or adafactor: torch's own")
    add(training, "--weight-decay", type=_non_negative, default=None,
        help="weight decay (default 0.1 for adamw, 0 for the others)")
    add(training, "--betas", type=_beta, nargs=2, default=(0.9, 0.95), metavar=("B1", "B2"),
        help="adamw and adam: the moments' decay rates (default 0.9 0.95)")
    add(training, "--momentum", type=_beta, default=0.9, help="sgd: momentum (default 0.9)")
    add(training, "--clip", type=_non_negative, default=1.0,
        help="global gradient-norm clip (default 1.0; 0 = off)")
    add(training, "--seed", type=int, default=0, help="seed of weights, data order and dropout")
    add(training, "--eval-every", type=_count, default=100,
        help="validation loss every N steps (default 100; 0 = off)")
    add(training, "--save-every", type=_count, default=0,
        help="checkpoint every N steps (default 0: only at the end)")
    add(training, "--keep-checkpoints", type=_positive_int, default=2,
        help="checkpoints kept in the run folder: the newest and N-1 older ones, to fall "
             "back on if the newest is damaged (default 2)")
    add(training, "--nonfinite", default="error", choices=("error", "skip"),
        help="a step with a non-finite loss or gradient norm: stop with an error, keeping "
             "the last good weights (error, the default), or skip its update (skip)")
    add(training, "--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
        help="fp32 (default), or mixed precision: bf16 or fp16 autocast in every stage, "
             "float32 weights; fp16 with a dynamic loss scale that skips overflowing steps")
    model = parser.add_argument_group("model")
    add(model, "--model", default="gpt", metavar="gpt|hf-gpt2|hf-llama|FILE.py:FUNCTION|FOLDER",
        help="pipetrain's GPT (default); a Hugging Face GPT-2 / Llama, unmodified (needs the "
             "[hf] extra); your own model: a Python file and the function in it that builds "
             "it (FILE.py:FUNCTION), or a Hugging Face model folder on disk (docs/user-models.md)")
    add(model, "--layers", type=_positive_int, default=4, help="transformer blocks (default 4)")
    add(model, "--width", type=_positive_int, default=64, help="embedding width (default 64)")
    add(model, "--heads", type=_positive_int, default=4, help="attention heads (default 4)")
    add(model, "--context", type=_positive_int, default=128, help="context length in bytes (default 128)")
    add(model, "--dropout", type=_rate, default=0.0, help="dropout rate (default 0)")
    data = parser.add_argument_group("data and output")
    add(data, "--data", default=None,
        help="a text file, or a folder of text files, to train on (default: the Python "
             "standard library's source)")
    add(data, "--out", default=None,
        help="run folder, new or empty (default runs/<date-time>; with --resume, the resumed run's)")
    add(data, "--resume", default=None, metavar="DIR",
        help="continue the run in DIR (a run folder, or a checkpoint folder) from its checkpoint")
    add(data, "--sample-bytes", type=_sample_bytes, default=300,
        help="bytes of text to sample at the end (default 300; 0 = none)")
    add(data, "--log", type=_trackers, default="tensorboard", metavar="NAME[,NAME]",
        help="where the step scalars go besides metrics.json: tensorboard (default), wandb "
             "(offline), mlflow (to mlruns/ in the run folder), a comma-separated list of "
             "them, or none")
    add(data, "--max-restarts", type=_count, default=0, metavar="N",
        help="when a worker dies or the job fails, restart the workers from the newest "
             "checkpoint (see --save-every), up to N times (default 0: the run ends)")
    add(data, "--config", default=None, metavar="FILE",
        help="a TOML file of options (any option by name, e.g. steps = 2000 or [pipeline] "
             "stages = 4); flags given here override it")
    add(data, "--timeout", type=_positive, default=300.0,
        help="seconds any wait may take, start-up included, before failing (default 300)")
    add(data, "--host-memory", default="keep", choices=HOST_MEMORY,
        help="on the CPU, the memory a step frees: keep it for the next step, as a GPU's "
             "caching allocator does (keep, the default: no page faults on the next step's "
             "activations; a worker's resident memory stays at its peak) or give it back "
             "as glibc's malloc does by default (release)")


def stages_per_rank(args: RunConfig) -> int:
    """``--virtual``, or its default for the schedule (2 for interleaved-1f1b,
    looped-bfs, zb-v and dualpipe-v, else 1)."""
    from pipetrain.schedule import default_stages_per_rank

    if args.virtual is not None:
        return int(args.virtual)
    try:
        return default_stages_per_rank(args.schedule)
    except ValueError:
        return 1


def asynchronous(args: RunConfig) -> bool:
    """Whether ``--schedule`` is an asynchronous schedule (pipedream, 2bw)."""
    from pipetrain.schedule import ASYNC_SCHEDULES, canonical_name

    try:
        return canonical_name(args.schedule) in ASYNC_SCHEDULES
    except ValueError:
        return False


def pipeline_fields(args: RunConfig) -> dict[str, Any]:
    """The :class:`~pipetrain.api.config.PipelineConfig` fields the options set (an
    asynchronous schedule clips nothing and applies every update: ``--clip`` and
    ``--nonfinite`` are refused with it, see :mod:`.train_checks`)."""
    clip = args.clip if args.clip > 0 else None
    if asynchronous(args):
        return {**_fields(args), "clip_grad_norm": None, "nonfinite": "ignore",
                "vertical_sync": bool(args.vertical_sync)}
    return {**_fields(args), "clip_grad_norm": clip, "vertical_sync": bool(args.vertical_sync)}


def _fields(args: RunConfig) -> dict[str, Any]:
    return {
        "schedule": args.schedule,
        "num_stages": args.stages,
        "stages_per_rank": stages_per_rank(args),
        "num_microbatches": args.microbatches * args.accumulate,
        "replicas": args.replicas,
        "checkpoint": args.checkpoint,
        "offload": offload_budgets(args.offload),
        "seed": args.seed,
        "timeout": args.timeout,
        "nonfinite": args.nonfinite,
        "mixed_precision": None if args.precision == "fp32" else args.precision,
        "data_parallel": "fsdp" if args.fsdp else "replicate",
        "tensor_parallel": args.tensor_parallel,
        "compile": bool(args.compile),
        "loss_per": "token",  # a padded step's loss is the mean over its real tokens
        "reshard_after_forward": bool(args.fsdp_reshard),
        "reduce_each_microbatch": bool(args.fsdp_reduce_each_microbatch),
        **failure_bounds(args.timeout),
    }


def failure_bounds(timeout: float) -> dict[str, float]:
    """How fast a worker finds a dead peer and ends, from ``--timeout``: a peer (or the
    store) silent for ``heartbeat_timeout`` seconds is dead, and a worker that a peer's
    failure left blocked in a call that cannot see it (a collective, a wait on a frozen
    or partitioned peer) is ended ``exit_when_stuck`` seconds later; both together stay
    within ``--timeout`` (the workers are the command's own processes).

    Example:
        >>> failure_bounds(300.0)
        {'heartbeat_timeout': 10.0, 'exit_when_stuck': 20.0}
        >>> failure_bounds(15.0)
        {'heartbeat_timeout': 5.0, 'exit_when_stuck': 10.0}
    """
    heartbeat = min(10.0, max(2.0, timeout / 3))
    return {"heartbeat_timeout": heartbeat,
            "exit_when_stuck": min(20.0, max(2.0, timeout - heartbeat))}


def pipeline_config(args: RunConfig) -> Any:
    """The :class:`~pipetrain.api.config.PipelineConfig` of the options."""
    from pipetrain.api.config import PipelineConfig

    return PipelineConfig(**pipeline_fields(args))


def gpt_config(args: RunConfig) -> Any:
    """The :class:`~pipetrain.models.GPTConfig` of the options."""
    from pipetrain.models import GPTConfig

    return GPTConfig(context=args.context, num_layers=args.layers, width=args.width,
                     num_heads=args.heads, dropout=args.dropout,
                     tie_embeddings=not asynchronous(args))


def recorded(args: RunConfig, names: Sequence[str] = ()) -> dict[str, Any]:
    """The options as a run folder records them (JSON-ready), but ``names``."""
    return {k: v for k, v in args.options().items() if k not in names}
