"""Everything ``pipetrain train`` can check before a worker starts, and what a resume does.

:func:`prepare` runs in the launcher (so that mistakes are named before any process
starts) and again in every worker (under torchrun there is no launcher); it has no side
effects, so every rank reaches the same verdict. A resume takes the options the user
did not give from the run it continues, honours the ones given (they are recorded as
changes), and refuses a change of the model's shape and a resume with nothing to do.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from pipetrain.cli.run_folder import read_json, resume_source
from pipetrain.cli.train_inputs import corpus_problem, hf_problem, out_problem
from pipetrain.cli.train_layout import layout_problems, stage_count_problem, virtual_needed
from pipetrain.cli.train_options import (
    MODEL_OPTIONS,
    RUN_OPTIONS,
    asynchronous,
    flag,
    pipeline_fields,
)

__all__ = ["Resume", "prepare"]

_NOT_OPTIONS = frozenset({"run", "given", "command", "verbose", "resumed"})


@dataclass
class Resume:
    """What a ``--resume`` continues."""

    checkpoint: str
    """The complete checkpoint folder to load."""
    step: int
    """The step the checkpoint was saved at."""
    run_folder: str | None
    """The run folder whose options and history continue (None: a bare checkpoint)."""
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Options given now that differ from the resumed run's: ``{name: (old, new)}``."""
    warnings: list[str] = field(default_factory=list)
    """Newer checkpoints passed over because they are damaged (one line each)."""


def _merge(args: argparse.Namespace, saved: dict[str, Any], changes: dict[str, tuple[Any, Any]],
           problems: list[str]) -> None:
    """Take the options not given from ``saved``; note the given ones that differ."""
    for name, old in saved.items():
        if name in RUN_OPTIONS or name in _NOT_OPTIONS or not hasattr(args, name):
            continue
        if name not in args.given:
            setattr(args, name, old)
            continue
        new = getattr(args, name)
        if new == old:
            continue
        if name in MODEL_OPTIONS:
            problems.append(
                f"{flag(name, new)} differs from the resumed run's {flag(name, old)}: a resume keeps "
                f"the model's shape; fix: leave out {flag(name, new).split()[0]}, or start a new run "
                "with another --out"
            )
        else:
            changes[name] = (old, new)


def _resume(args: argparse.Namespace, problems: list[str]) -> Resume | None:
    from pipetrain.api.checkpoint_files import find_intact, read_meta

    if not os.path.exists(args.resume):
        problems.append(f"--resume {args.resume!r}: no such run folder or checkpoint")
        return None
    source = resume_source(args.resume)
    found, damaged = find_intact(source.checkpoint)
    if found is None:
        where = source.run_folder or args.resume
        if damaged:
            listed = "; ".join(f"{c.path} (step {c.step}): {why}" for c, why in damaged)
            problems.append(
                f"--resume {args.resume!r}: no intact checkpoint in {where!r}: {listed}; fix: "
                "restore the damaged files, or start the run again without --resume")
        else:
            problems.append(
                f"--resume {args.resume!r}: {where!r} holds no complete checkpoint (a run stopped "
                "before its first save has none); fix: start the run again without --resume, or "
                "resume a run folder that has checkpoint/"
            )
        return None
    step = int(read_meta(found.path)["step"])
    resume = Resume(checkpoint=found.path, step=step, run_folder=source.run_folder,
                    warnings=[f"checkpoint {c.path} (step {c.step}) is damaged: {why}; resuming "
                              f"from {found.path} (step {step}) instead" for c, why in damaged])
    if source.run_folder is not None:
        saved = read_json(os.path.join(source.run_folder, "config.json")) or {}
        _merge(args, dict(saved.get("args", {})), resume.changes, problems)
        if args.out is None:
            args.out = source.run_folder
    if args.steps <= step:
        problems.append(
            f"nothing to do: the checkpoint of {args.resume!r} is at step {step} and --steps is "
            f"{args.steps}; --steps is the step to reach, not how many to add; fix: e.g. "
            f"--steps {step + 100} to train 100 more steps"
        )
    return resume


def _option_problems(args: argparse.Namespace) -> list[str]:
    from pipetrain.api.config import config_problems
    from pipetrain.data import load_corpus

    problems = layout_problems(args) + _async_problems(args)
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


def _schedule_file(args: argparse.Namespace) -> None:
    """With ``--schedule FILE``, take ``--stages``, ``--virtual`` and ``--microbatches``
    from the file where they were not given (a given one that differs is reported by
    the configuration's check, with its fix)."""
    from pipetrain.api.user_schedule import is_schedule_file
    from pipetrain.schedule import load_schedule

    if not is_schedule_file(args.schedule):
        return
    try:
        schedule = load_schedule(args.schedule)
    except (OSError, ValueError):
        return  # the configuration's check names the problem
    taken = {"stages": schedule.num_ranks, "microbatches": schedule.num_microbatches,
             "virtual": max(1, schedule.num_stages // schedule.num_ranks)}
    for option, value in taken.items():
        if option not in args.given:
            setattr(args, option, value)


def _async_problems(args: argparse.Namespace) -> list[str]:
    """``--clip`` and ``--nonfinite`` given with an asynchronous schedule."""
    if not asynchronous(args):
        return []
    problems = []
    if "clip" in args.given and args.clip > 0:
        problems.append(
            f"--clip {args.clip:g} with --schedule {args.schedule}: its stages update on their own, "
            "at their own times, so no update has a gradient norm over all stages to clip by; "
            "fix: leave out --clip")
    if "nonfinite" in args.given:
        problems.append(
            f"--nonfinite {args.nonfinite} with --schedule {args.schedule}: its stages apply their "
            "updates at different times, before the step's loss is known everywhere, so a step "
            "cannot be refused or skipped whole; fix: leave out --nonfinite (the losses show a "
            "non-finite step)")
    return problems


def prepare(args: argparse.Namespace) -> tuple[Resume | None, list[str]]:
    """Resolve a resume into ``args`` (in place) and find every problem with the options.

    Returns the resume (None without ``--resume``) and the problems, each naming the bad
    value and its fix in command-line terms.
    """
    problems: list[str] = []
    resume = _resume(args, problems) if args.resume is not None else None
    _schedule_file(args)
    if resume is not None and "schedule" in resume.changes:
        old, new = resume.changes["schedule"]
        if asynchronous(argparse.Namespace(schedule=old)) != asynchronous(args):
            problems.append(
                f"--schedule {new} differs from the resumed run's --schedule {old} in kind: the "
                "asynchronous schedules train the GPT with untied embeddings, the synchronous "
                f"ones with tied embeddings; fix: leave out --schedule, or --schedule {old}")
    problems.extend(_option_problems(args))
    folder = out_problem(args.out, resume=args.resume)
    if folder is not None:
        problems.append(folder)
    return resume, problems
