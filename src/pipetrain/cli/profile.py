"""``pipetrain profile``: measure every layer of a run's model into a profile file for
``pipetrain plan``.

It takes ``pipetrain train``'s options (so the same command line or ``--config`` file
describes the run to profile and the run to train): the model (``--model``, its shape),
the data, and the batch: each layer is timed at the micro-batch size the run will use
(``--batch-size / (--replicas x --microbatches)``) and at one replica's batch, with each
process's share of the cores as a worker of a ``--stages x --replicas`` run has it.
Every layer is timed ``--repetitions`` times; the spread of those times is reported per
layer, with a warning when it is large (a busy machine: profile again when it is quiet).
The profile records the model's identity, so ``pipetrain train --plan`` refuses a plan
made for another model. A progress line counts the layers measured.

    pipetrain profile --layers 8 --width 256 --out profile.json
    pipetrain plan --profile profile.json --workers 2 --bandwidth 1e9 --out plan.json
    pipetrain train --layers 8 --width 256 --plan plan.json
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pipetrain.cli.train_options import add_train_arguments
from pipetrain.counts import count_of

__all__ = ["ALIKE_WARNING", "SPREAD_WARNING", "add_parser", "profile_warnings", "run"]

SPREAD_WARNING = 0.2
ALIKE_WARNING = 1.5
"""Layers alike in kind and size whose times differ by more than this factor are named."""
"""A layer whose repetitions spread more than this (relative) is reported as unreliable."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``profile`` on the ``pipetrain`` command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "profile", help="measure every layer of a run's model for `pipetrain plan`",
        description="Profile the model that `pipetrain train` with the same options would "
                    "train (every train option but --out and --resume is accepted; the model, "
                    "data and batch ones matter) and write the profile for `pipetrain plan`.",
        conflict_handler="resolve")  # --out and --resume replace train's
    add_train_arguments(parser)
    extra = parser.add_argument_group("profile")
    extra.add_argument("--out", dest="output", default="profile.json", metavar="FILE",
                       help="the profile file to write (default profile.json)")
    extra.add_argument("--output", dest="output", default="profile.json", help=argparse.SUPPRESS)
    extra.add_argument("--resume", default=None, help=argparse.SUPPRESS)
    extra.add_argument("--repetitions", type=int, default=20,
                       help="timed repetitions of each layer (default 20; their median counts)")
    extra.add_argument("--device", default=None,
                       help="the device to profile on (default: cuda if there is one, else cpu)")
    extra.add_argument("--threads", type=int, default=None,
                       help="intra-op threads (default: the cores a worker of the run gets: "
                            "cores / (stages x replicas))")
    parser.set_defaults(run=run, out=None)
    return parser


def _fail(problems: list[str]) -> int:
    for problem in problems:
        sys.stderr.write(f"pipetrain profile: error: {problem}\n")
    return 2


def run(args: argparse.Namespace) -> int:
    """Profile the run's model; 2 with the problems on bad input."""
    from pipetrain.cli.train_checks import prepare

    if args.resume is not None:
        return _fail([f"--resume {args.resume!r}: pipetrain profile measures a model, it does "
                      "not continue a run; fix: give the run's model options (or its --config "
                      "file) without --resume"])
    config, _, problems = prepare(args)
    problems = [p for p in problems if not p.startswith(("--out", "the default --out"))]
    if args.repetitions < 3:
        problems.append(f"--repetitions {args.repetitions} is too few to tell a spread; fix: "
                        "--repetitions 20")
    if problems:
        return _fail(problems)
    import torch

    from pipetrain.bench.harness.noise import load_warning
    from pipetrain.cli.run_model import profile_inputs, run_dataset
    from pipetrain.cli.train_options import gpt_config
    from pipetrain.plan.profiler import profile_model
    from pipetrain.trace import ProgressBar

    load_before = load_warning()
    workers = config.num_workers
    threads = args.threads or max(1, (os.cpu_count() or 1) // workers)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dataset, tokenizer = run_dataset(config)
        layers, sample, loss_fn, targets = profile_inputs(
            config, gpt_config(config), dataset, vocab_size=tokenizer.vocab_size)
        rows = max(1, config.batch_size // config.replicas)
        microbatch = max(1, rows // config.microbatches)
        sys.stderr.write(f"profiling {count_of(len(layers), 'layer')} at micro-batches of {microbatch} "
                         f"(and batches of {rows}), {args.repetitions} repetitions, "
                         f"{threads} thread{'' if threads == 1 else 's'}...\n")
        with ProgressBar(len(layers), unit="layer", log_every_steps=1) as bar:
            profile = profile_model(layers, sample, microbatch_size=microbatch, loss_fn=loss_fn,
                                    target=targets, repetitions=args.repetitions,
                                    device=args.device,
                                    progress=lambda done, total: bar.update(done))
    finally:
        torch.set_num_threads(before)
    if config.model == "gpt":
        from pipetrain.cli.train_layout import model_identity

        profile = _with_model(profile, model_identity(config))
    profile.save(args.output)
    _report(profile, args.output, load_before=load_before)
    return 0


def _with_model(profile: Any, identity: dict[str, Any]) -> Any:
    import dataclasses

    return dataclasses.replace(profile, model=identity)


def profile_warnings(profile: Any, *, load_before: str | None = None) -> list[str]:
    """Why the times of ``profile`` may not be trusted, one line each: layers whose
    repetitions spread by more than :data:`SPREAD_WARNING`, layers alike in kind and size
    whose times differ by more than :data:`ALIKE_WARNING` times (a busy spell hit one of
    them), and a load average above the core count (``load_before``: the one seen when
    the measurements started).

    Example:
        >>> from pipetrain.plan import LayerProfile, Profile
        >>> block = dict(description="Block(64)", backward_s=1e-3, parameter_bytes=100)
        >>> alike = [LayerProfile(name=str(i), forward_s=t, **block) for i, t in enumerate([1e-3, 1e-3, 2.3e-3])]
        >>> profile_warnings(Profile(layers=tuple(alike)))[0]
        'layers 0, 1 and 2 are alike (Block(64)) but took 2.0 to 3.3 ms (1.6x)'
    """
    from pipetrain.bench.harness.noise import load_warning

    warnings = []
    noisy = [(layer.name, layer.spread) for layer in profile.layers
             if (layer.spread or 0.0) > SPREAD_WARNING]
    if noisy:
        worst = max(spread for _, spread in noisy)
        warnings.append(f"the repetitions of layer(s) {', '.join(n for n, _ in noisy)} spread by "
                        f"more than {SPREAD_WARNING:.0%} (up to {worst:.0%})")
    groups: dict[tuple[str, int, int], list[Any]] = {}
    for layer in profile.layers:
        key = (layer.description, layer.parameter_bytes, layer.output_bytes)
        groups.setdefault(key, []).append(layer)
    for (description, _, _), alike in groups.items():
        times = [_time(layer) for layer in alike]
        if len(alike) > 1 and description and min(times) > 0 and max(times) > ALIKE_WARNING * min(times):
            names = [layer.name for layer in alike]
            listed = ", ".join(names[:-1]) + f" and {names[-1]}"
            warnings.append(f"layers {listed} are alike ({description[:40]}) but took "
                            f"{min(times) * 1e3:.1f} to {max(times) * 1e3:.1f} ms "
                            f"({max(times) / min(times):.1f}x)")
    for load in (load_before, load_warning()):
        if load is not None and load not in warnings:
            warnings.append(load)
    return warnings


def _time(layer: Any) -> float:
    forward = layer.microbatch_forward_s if layer.microbatch_forward_s is not None else layer.forward_s
    backward = (layer.microbatch_backward_s if layer.microbatch_backward_s is not None
                else layer.backward_s)
    return float(forward + backward)


def _report(profile: Any, path: str, *, load_before: str | None) -> None:
    lines = [f"{'layer':>5}  {'forward ms':>10}  {'backward ms':>11}  {'spread':>6}  what"]
    for layer in profile.layers:
        forward = layer.microbatch_forward_s if layer.microbatch_forward_s is not None else layer.forward_s
        backward = (layer.microbatch_backward_s if layer.microbatch_backward_s is not None
                    else layer.backward_s)
        lines.append(f"{layer.name:>5}  {forward * 1e3:10.3f}  {backward * 1e3:11.3f}  "
                     f"{layer.spread or 0.0:6.0%}  {layer.description[:60]}")
    sys.stdout.write("\n".join(lines) + "\n")
    summary = profile.model.get("summary", f"{profile.num_layers} layers")
    sys.stdout.write(f"wrote {path}: {summary}, times at micro-batches of "
                     f"{profile.microbatch_size} on {profile.device}\n")
    warnings = profile_warnings(profile, load_before=load_before)
    for warning in warnings:
        sys.stderr.write(f"pipetrain profile: warning: {warning}\n")
    if warnings:
        sys.stderr.write("pipetrain profile: a plan from these times may cut badly; profile "
                         "again when the machine is quiet, or with more --repetitions\n")
