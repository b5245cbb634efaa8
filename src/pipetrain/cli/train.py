"""``pipetrain train``: the main job's command line.

Without arguments it trains a small character-level GPT on the Python standard library's
own source files: 2 pipeline stages, 8 micro-batches, 1F1B, a few minutes on a 2-core
CPU. Outside a torch.distributed job the command launches its workers itself (through
torch.distributed.elastic); inside one (torchrun, or the workers it launched) it trains.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

__all__ = ["add_parser", "run"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``train`` on the ``pipetrain`` command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "train",
        help="train a GPT as a pipeline (the main job)",
        description=(
            "Train a character-level GPT with pipeline parallelism. Run as is, it spawns "
            "stages x replicas local workers; under torchrun it is one worker of a "
            "multi-machine job: torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT -m pipetrain train --stages K --replicas D "
            "(with N x P = K x D)."
        ),
    )
    layout = parser.add_argument_group("pipeline")
    layout.add_argument("--stages", type=_positive, default=2, help="pipeline ranks K (default 2)")
    layout.add_argument("--replicas", type=_positive, default=1, help="data-parallel replicas D (default 1)")
    layout.add_argument("--microbatches", type=_positive, default=8, help="micro-batches M per step (default 8)")
    layout.add_argument("--schedule", default="1f1b",
                        help="gpipe, 1f1b, interleaved-1f1b or zb-h1 (default 1f1b)")
    layout.add_argument("--virtual", type=_positive, default=None,
                        help="stages per rank for interleaved-1f1b (default 2)")
    layout.add_argument("--checkpoint", default="never", choices=("always", "except_last", "never"),
                        help="re-materialization mode (default never)")
    training = parser.add_argument_group("training")
    training.add_argument("--steps", type=_positive, default=1000, help="optimizer steps (default 1000)")
    training.add_argument("--batch-size", type=_positive, default=32, help="sequences per step (default 32)")
    training.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    training.add_argument("--warmup", type=int, default=50, help="linear warm-up steps (default 50)")
    training.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (default 1.0; 0 = off)")
    training.add_argument("--seed", type=int, default=0, help="seed of weights, data order and dropout")
    training.add_argument("--eval-every", type=int, default=100, help="validation loss every N steps (0 = off)")
    training.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0 = only at the end)")
    model = parser.add_argument_group("model")
    model.add_argument("--layers", type=_positive, default=4, help="transformer blocks (default 4)")
    model.add_argument("--width", type=_positive, default=64, help="embedding width (default 64)")
    model.add_argument("--heads", type=_positive, default=4, help="attention heads (default 4)")
    model.add_argument("--context", type=_positive, default=128, help="context length in bytes (default 128)")
    model.add_argument("--dropout", type=float, default=0.0, help="dropout rate (default 0)")
    data = parser.add_argument_group("data and output")
    data.add_argument("--data", default=None, help="a text file to train on (default: the Python standard library's source)")
    data.add_argument("--out", default=None, help="run folder (default runs/<date-time>)")
    data.add_argument("--resume", default=None, metavar="DIR",
                      help="continue from a run folder's checkpoint (or a checkpoint folder)")
    data.add_argument("--sample-bytes", type=int, default=300, help="text to sample at the end (0 = none)")
    data.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a peer before failing")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Launch the workers (or, inside a job, be one)."""
    from pipetrain.launch import LaunchError, in_worker, launch_local

    if in_worker():
        from pipetrain.cli.train_job import train_worker

        return train_worker(args)
    problems = _check(args)
    if problems:
        for problem in problems:
            sys.stderr.write(f"pipetrain train: error: {problem}\n")
        return 2
    if args.out is None:
        args.out = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    argv = _argv_with_out(sys.argv[1:], args.out)
    try:
        launch_local(args.stages * args.replicas, argv)
    except LaunchError as error:
        sys.stderr.write(f"pipetrain train: error: {error}\n")
        return 1
    return 0


def _argv_with_out(argv: list[str], out: str) -> list[str]:
    argv = list(argv)
    if "--out" not in argv and not any(a.startswith("--out=") for a in argv):
        argv += ["--out", out]
    return argv


def _check(args: argparse.Namespace) -> list[str]:
    """Every problem with the arguments that can be found before starting workers."""
    from pipetrain.models import GPTConfig

    problems: list[str] = []
    try:
        GPTConfig(context=args.context, num_layers=args.layers, width=args.width,
                  num_heads=args.heads, dropout=args.dropout)
    except ValueError as error:
        problems.append(str(error))
    try:
        _pipeline_config(args)
    except ValueError as error:
        problems.append(str(error))
    num_layers = args.layers + 2
    stages = args.stages * (_virtual(args) or 1)
    if stages > num_layers:
        problems.append(
            f"more stages than layers: {stages} stages for {num_layers} layers (embedding, "
            f"{args.layers} blocks, head); fix: --stages {max(1, num_layers // (_virtual(args) or 1))} "
            f"or --layers {stages - 2}"
        )
    if args.data is not None and not os.path.isfile(args.data):
        problems.append(f"--data {args.data!r}: no such file")
    if args.resume is not None and not os.path.exists(args.resume):
        problems.append(f"--resume {args.resume!r}: no such run folder or checkpoint")
    return problems


def _virtual(args: argparse.Namespace) -> int | None:
    from pipetrain.schedule import canonical_name

    try:
        interleaved = canonical_name(args.schedule) == "interleaved-1f1b"
    except ValueError:
        return args.virtual  # type: ignore[no-any-return]
    if args.virtual is not None:
        return args.virtual  # type: ignore[no-any-return]
    return 2 if interleaved else 1


def _pipeline_config(args: argparse.Namespace) -> Any:
    from pipetrain.api.config import PipelineConfig

    return PipelineConfig(
        schedule=args.schedule,
        num_stages=args.stages,
        stages_per_rank=_virtual(args) or 1,
        num_microbatches=args.microbatches,
        replicas=args.replicas,
        checkpoint=args.checkpoint,
        clip_grad_norm=args.clip if args.clip > 0 else None,
        seed=args.seed,
        timeout=args.timeout,
    )
