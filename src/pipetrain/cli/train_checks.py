"""Everything ``pipetrain train`` can check before a worker starts.

:func:`prepare` resolves the command into its :class:`~.run_config.RunConfig` (see
:mod:`.train_resolve`) and checks it. It runs in the launcher (so that mistakes are named
before any process starts) and again in every worker (under torchrun there is no
launcher); it has no side effects, so every rank reaches the same verdict.
"""

from __future__ import annotations

import argparse
import os

from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.train_inputs import corpus_problem, hf_problem, out_problem
from pipetrain.cli.train_layout import layout_problems, stage_count_problem, virtual_needed
from pipetrain.cli.train_options import asynchronous, flag, pipeline_fields
from pipetrain.cli.train_resolve import Resume, resolve

__all__ = ["RECIPES", "Resume", "prepare", "schedule_notes"]

RECIPES = {"2bw": (3e-4, 100)}
"""The asynchronous schedules' recipes: (the highest peak LR, the fewest steps) within
which their validation loss came within 2% of 1F1B's (docs/asynchronous.md, measured
by ``pipetrain bench async_convergence``)."""


def _option_problems(args: RunConfig) -> list[str]:
    from pipetrain.api.config import config_problems
    from pipetrain.data import load_corpus

    problems = layout_problems(args) + _async_problems(args) + _optimizer_problems(args)
    memory = _memory_problem(args)
    if memory is not None:
        problems.append(memory)
    too_many = stage_count_problem(args)
    if args.plan is None:
        found = config_problems(pipeline_fields(args), spell=flag)
        if too_many is not None and "(not --virtual" in too_many:
            # the stage count's line names the stages per rank the schedule needs, with a
            # fix for both: the configuration's line about --virtual alone is left out
            fixed = dict(pipeline_fields(args), stages_per_rank=virtual_needed(args))
            found = [p for p in found if p in config_problems(fixed, spell=flag)]
        problems += found
    if args.width % args.heads:
        fitting = max(h for h in range(1, args.heads + 1) if args.width % h == 0)
        problems.append(
            f"--width {args.width} is not divisible by --heads {args.heads}; fix: --heads {fitting} "
            f"or --width {-(-args.width // args.heads) * args.heads}"
        )
    if too_many is not None:
        problems.append(too_many)
    per_replica = args.batch_size // args.replicas
    if per_replica < args.microbatches and args.plan is None:
        problems.append(
            f"--batch-size {args.batch_size} gives each of the {args.replicas} replica(s) "
            f"{per_replica} sequences, too few for --microbatches {args.microbatches} (each "
            f"micro-batch needs one); fix: --batch-size {args.microbatches * args.replicas} or "
            f"--microbatches {max(1, per_replica)}"
        )
    corpus_error = None
    if args.data is not None:
        try:
            load_corpus(args.data, max_bytes=1 << 16)
        except (OSError, ValueError) as error:
            corpus_error = f"--data {args.data!r}: {error}"
    short = corpus_problem(args, context_fixed=args.resume is not None)
    problems += [p for p in (corpus_error or short, hf_problem(args)) if p is not None]
    return problems


def _optimizer_problems(args: RunConfig) -> list[str]:
    """An optimizer's setting given to another optimizer, and a final learning rate above
    the peak."""
    problems = []
    takes = {"betas": ("adamw", "adam"), "momentum": ("sgd",)}
    for name, optimizers in takes.items():
        if args.given(name) and args.optimizer not in optimizers:
            problems.append(f"{flag(name, getattr(args, name))} is a setting of --optimizer "
                            f"{' or '.join(optimizers)}, not of --optimizer {args.optimizer}; "
                            f"fix: leave out --{name}, or --optimizer {optimizers[0]}")
    if args.accumulate > 1 and asynchronous(args):
        problems.append(f"--accumulate {args.accumulate} with --schedule {args.schedule}: an "
                        "asynchronous schedule updates after every micro-batch, so there is no "
                        "step to accumulate into; fix: leave out --accumulate, or a synchronous "
                        "schedule (1f1b)")
    if args.min_lr is not None and args.min_lr > args.lr:
        problems.append(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}: the schedule "
                        f"decays from --lr down to --min-lr; fix: --min-lr {args.lr / 10:g}")
    return problems


def schedule_notes(args: RunConfig) -> list[str]:
    """What the schedule changed of the options (``note: ...``) and a run outside its
    schedule's recipe (``warning: ...``), one line each, said at start-up.

    Example:
        >>> config = RunConfig(schedule="2bw", lr=1e-2, steps=300)
        >>> config.set("schedule", clip=0.0, nonfinite="ignore")
        >>> [line.split(":")[0] for line in schedule_notes(config)]
        ['note', 'warning']
    """
    if not args.asynchronous:
        return []
    notes = []
    changed = [flag(name, getattr(args, name)) for name in ("clip", "nonfinite")
               if args.source(name) == "schedule"]
    if changed:
        notes.append(f"note: --schedule {args.schedule} runs with {' and '.join(changed)}: its "
                     "stages update on their own, so there is no gradient norm over all stages "
                     "to clip by and no step to refuse whole")
    from pipetrain.schedule import canonical_name

    recipe = RECIPES.get(canonical_name(args.schedule))
    if recipe is not None and (args.lr > recipe[0] or args.steps < recipe[1]):
        lr, steps = recipe
        notes.append(f"warning: --schedule {args.schedule} with --lr {args.lr:g} and --steps "
                     f"{args.steps} is outside its recipe (a peak LR of at most {lr:g} and at "
                     f"least {steps} steps; outside it, its validation loss came out up to 27.5% "
                     f"above 1F1B's: docs/asynchronous.md); fix: --lr {lr:g}"
                     + (f" --steps {steps}" if args.steps < steps else ""))
    return notes


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _memory_problem(args: RunConfig) -> str | None:
    """The built-in GPT's options that cannot fit this machine's memory, named: a lower
    bound of what the workers here hold (each its batch of token ids, and its stage's
    weights, gradients and AdamW state), against the machine's physical memory."""
    total = _physical_memory()
    if args.model != "gpt" or total is None:
        return None
    width, vocab = args.width, 256
    params = args.layers * (12 * width * width + 13 * width) + (vocab + args.context) * width
    params += 0 if not asynchronous(args) else vocab * width  # an untied head
    batch = 8 * args.step_batch_size * (args.context + 1)  # int64 token ids
    stage = 16 * params // args.stages
    here = int(os.environ.get("LOCAL_WORLD_SIZE", args.num_workers))
    need = here * (batch + stage)
    if need <= total:
        return None
    gib = 2.0**30
    return (f"this job needs at least {need / gib:,.1f} GiB on this machine, which has "
            f"{total / gib:,.1f} GiB: each of its {here} workers holds a batch of --batch-size "
            f"{args.batch_size}{f' x --accumulate {args.accumulate}' if args.accumulate > 1 else ''}"
            f" x --context {args.context} token ids ({batch / gib:,.1f} GiB) and "
            f"its stage's weights, gradients and AdamW state ({stage / gib:,.1f} GiB for --layers "
            f"{args.layers} --width {args.width} over --stages {args.stages}); fix: a smaller "
            "--batch-size, --context, --width or --layers, or more --stages")


def _async_problems(args: RunConfig) -> list[str]:
    """``--clip`` and ``--nonfinite`` given with an asynchronous schedule."""
    if not asynchronous(args):
        return []
    problems = []
    if args.given("clip") and args.clip > 0:
        problems.append(
            f"--clip {args.clip:g} with --schedule {args.schedule}: its stages update on their own, "
            "at their own times, so no update has a gradient norm over all stages to clip by; "
            "fix: leave out --clip")
    if args.given("nonfinite"):
        problems.append(
            f"--nonfinite {args.nonfinite} with --schedule {args.schedule}: its stages apply their "
            "updates at different times, before the step's loss is known everywhere, so a step "
            "cannot be refused or skipped whole; fix: leave out --nonfinite (the losses show a "
            "non-finite step)")
    return problems


def prepare(args: argparse.Namespace, *, command_line: list[str] | None = None,
            ) -> tuple[RunConfig, Resume | None, list[str]]:
    """Resolve the command into its configuration and find every problem with it
    (``command_line``: as the user typed it, recorded; default ``sys.argv``).

    Returns the configuration, the resume (None without ``--resume``) and the problems,
    each naming the bad value and its fix in command-line terms.
    """
    config, resume, problems = resolve(args, command_line=command_line)
    if resume is not None and "schedule" in resume.changes:
        old, new = resume.changes["schedule"]
        if asynchronous(RunConfig(schedule=old)) != asynchronous(config):
            problems.append(
                f"--schedule {new} differs from the resumed run's --schedule {old} in kind: the "
                "asynchronous schedules train the GPT with untied embeddings, the synchronous "
                f"ones with tied embeddings; fix: leave out --schedule, or --schedule {old}")
    problems.extend(_option_problems(config))
    folder = out_problem(config.out, resume=config.resume)
    if folder is not None:
        problems.append(folder)
    return config, resume, problems
