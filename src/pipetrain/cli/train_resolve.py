"""Resolving a ``pipetrain train`` command into its :class:`~.run_config.RunConfig`, once.

:func:`resolve` merges, in this order (each later one wins for what it sets): the
defaults, the options of the run a ``--resume`` continues (its ``config.json``),
``--config FILE``, the command line, a schedule file's stages, micro-batches and stages
per rank (where not given), a ``--plan``'s layout (its stages, replicas per stage and cut,
and its schedule, micro-batches and checkpoint mode where not given), and the schedule's
own rules (its stages per rank by default; an asynchronous schedule clips nothing and
applies every update). It has no side effects, so the launcher and every worker reach
the same configuration. A resume also notes the options given now that differ from the
run's (``Resume.changes``) and refuses a change of the model's shape.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.run_folder import read_json, resume_source
from pipetrain.cli.train_options import MODEL_OPTIONS, RUN_OPTIONS, flag

__all__ = ["Resume", "resolve", "saved_options"]


@dataclass
class Resume:
    """What a ``--resume`` continues."""

    checkpoint: str
    """The checkpoint path whose newest intact copy the job loads (verified then)."""
    step: int
    """The step the checkpoint was saved at."""
    run_folder: str | None
    """The run folder whose options and history continue (None: a bare checkpoint)."""
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Options given now that differ from the resumed run's: ``{name: (old, new)}``."""


def saved_options(run_folder: str) -> dict[str, Any]:
    """The options a run folder's ``config.json`` records (``options``; ``args`` in runs
    of earlier versions), or ``{}``."""
    saved = read_json(os.path.join(run_folder, "config.json")) or {}
    return dict(saved.get("options") or saved.get("args") or {})


def _find_resume(path: str, problems: list[str]) -> Resume | None:
    """The newest checkpoint whose files match its manifest and index (the checksums are
    read once, by the job's rank 0, when it loads: it may fall back further)."""
    from pipetrain.api.checkpoint_files import find_intact

    if not os.path.exists(path):
        problems.append(f"--resume {path!r}: no such run folder or checkpoint")
        return None
    source = resume_source(path)
    found, damaged = find_intact(source.checkpoint, checksums=False)
    if found is None or found.step is None:
        where = source.run_folder or path
        unfinished = all(why.startswith("no .metadata") and c.step is None for c, why in damaged)
        if damaged and not unfinished:
            listed = "; ".join(f"{c.path}" + (f" (step {c.step})" if c.step is not None else "")
                               + f": {why}" for c, why in damaged)
            problems.append(
                f"--resume {path!r}: no intact checkpoint in {where!r}: {listed}; fix: "
                "restore the damaged files, or start the run again without --resume")
        else:
            problems.append(
                f"--resume {path!r}: {where!r} holds no complete checkpoint (a run stopped "
                "before its first save has none); fix: start the run again without --resume, or "
                "resume a run folder that has checkpoint/")
        return None
    return Resume(checkpoint=source.checkpoint, step=found.step, run_folder=source.run_folder)


def _given(args: argparse.Namespace, problems: list[str]) -> dict[str, tuple[str, Any]]:
    """The options the user gave for this invocation: ``{name: (source, value)}``, the
    config file's first, the command line's over them."""
    given: dict[str, tuple[str, Any]] = {}
    path = getattr(args, "config", None)
    if path is not None:
        from pipetrain.cli.config_file import read_config_file

        values, found = read_config_file(path)
        problems += found
        if values is not None:
            given |= {name: ("config file", getattr(values, name)) for name in values.given}
    return given | {name: ("command line", getattr(args, name)) for name in args.given
                    if name != "config"}


def _resumed(config: RunConfig, resume: Resume, given: dict[str, tuple[str, Any]],
             problems: list[str]) -> None:
    """Take the resumed run's options that were not given; note the given ones that differ."""
    if resume.run_folder is None:
        return
    names = set(RunConfig.option_names()) - set(RUN_OPTIONS) - {"config"}
    for name, old in saved_options(resume.run_folder).items():
        if name not in names:
            continue
        if name in ("stage_replicas", "betas") and old is not None:
            old = tuple(old)
        if name not in given:
            config.set("resumed run", **{name: old})
            continue
        new = given[name][1]
        if new == old:
            continue
        if name in MODEL_OPTIONS:
            problems.append(
                f"{flag(name, new)} differs from the resumed run's {flag(name, old)}: a resume keeps "
                f"the model's shape and its optimizer's state; fix: leave out "
                f"{flag(name, new).split()[0]}, or start a new run with another --out")
        else:
            resume.changes[name] = (old, new)


def _anchored(name: str, value: Any) -> Any:
    """A path the run records absolute, so that ``sample`` and ``--resume`` find it from
    any folder: ``--data``, and a model file or folder."""
    if name == "data" and isinstance(value, str):
        return os.path.abspath(value)
    if name == "betas" and value is not None:
        return tuple(float(v) for v in value)
    if name == "model" and isinstance(value, str):
        from pipetrain.cli.user_models import is_user_model

        if is_user_model(value):
            path, colon, function = value.rpartition(":")
            if colon and path.endswith(".py"):
                return f"{os.path.abspath(path)}:{function}"
            return os.path.abspath(value)
    return value


def _schedule_file(config: RunConfig) -> None:
    """A schedule file's stages, micro-batches and stages per rank, where not given (a
    given one that differs is reported by the configuration's check, with its fix)."""
    from pipetrain.api.user_schedule import is_schedule_file
    from pipetrain.schedule import load_schedule

    if not is_schedule_file(config.schedule):
        return
    try:
        schedule = load_schedule(config.schedule)
    except (OSError, ValueError):
        return  # the configuration's check names the problem
    taken = {"stages": schedule.num_ranks, "microbatches": schedule.num_microbatches,
             "virtual": max(1, schedule.num_stages // schedule.num_ranks)}
    config.set("schedule file", **{k: v for k, v in taken.items() if not config.given(k)})


def _plan(config: RunConfig) -> None:
    """A plan's layout (stages, replicas per stage, cut) and, where not given, its
    schedule, micro-batches, checkpoint mode and FSDP (a plan that cannot be read is left
    to the layout's check, which names the problem)."""
    from pipetrain.api.plan_config import plan_balance
    from pipetrain.plan import Plan

    if config.plan is None or not os.path.isfile(config.plan):
        return
    try:
        plan = Plan.load(config.plan)
        balance = plan_balance(plan)
    except (OSError, ValueError, KeyError, TypeError):
        return
    replicas = tuple(stage.replicas for stage in plan.stages)
    even = len(set(replicas)) == 1
    values: dict[str, Any] = {"stages": len(balance), "virtual": 1,
                              "balance": ",".join(map(str, balance)),
                              "replicas": replicas[0] if even else 1,
                              "stage_replicas": None if even else replicas}
    fsdp = True if plan.data_parallel == "fsdp" else None
    for option, value in (("schedule", plan.schedule), ("microbatches", plan.num_microbatches),
                          ("checkpoint", plan.checkpoint), ("fsdp", fsdp),
                          ("fsdp_reshard", plan.reshard_after_forward or None),
                          ("fsdp_reduce_each_microbatch", plan.reduce_each_microbatch or None)):
        if value is not None and not config.given(option):
            values[option] = value
    config.set("plan", **{k: v for k, v in values.items()
                          if not config.given(k) or k in ("stage_replicas",)})


def _schedule_rules(config: RunConfig) -> None:
    """The schedule's default stages per rank; an asynchronous schedule's clip (none) and
    handling of non-finite steps (every update applied)."""
    from pipetrain.schedule import default_stages_per_rank

    if config.virtual is None:
        try:
            virtual = default_stages_per_rank(config.schedule)
        except ValueError:
            virtual = 1
        config.set("schedule", virtual=virtual)
    if config.asynchronous:
        if not config.given("clip"):
            config.set("schedule", clip=0.0)
        if not config.given("nonfinite"):
            config.set("schedule", nonfinite="ignore")


def resolve(args: argparse.Namespace, *, command_line: list[str] | None = None,
            ) -> tuple[RunConfig, Resume | None, list[str]]:
    """The run's configuration, its resume (None without ``--resume``), and the problems
    found while merging (a bad config file, a resume without checkpoint, a changed model
    shape), each naming the bad value and its fix in command-line terms.

    Example::

        config, resume, problems = resolve(parser.parse_args(["train", "--plan", "plan.json"]))
        config.stages, config.source("stages")      # 3, 'plan'
    """
    problems: list[str] = []
    config = RunConfig()
    config.command_line = tuple(sys.argv[1:] if command_line is None else command_line)
    given = _given(args, problems)
    if getattr(args, "config", None) is not None:
        config.set("command line", config=args.config)
    resume_path = given["resume"][1] if "resume" in given else None
    resume = _find_resume(resume_path, problems) if resume_path is not None else None
    if resume is not None:
        _resumed(config, resume, given, problems)
    for name, (source, value) in given.items():
        config.set(source, **{name: _anchored(name, value)})
    if resume is not None and resume.run_folder is not None and config.out is None:
        config.out = resume.run_folder
    _schedule_file(config)
    _plan(config)
    _schedule_rules(config)
    if resume is not None and config.steps <= resume.step:
        problems.append(
            f"nothing to do: the checkpoint of {resume_path!r} is at step {resume.step} and "
            f"--steps is {config.steps}; --steps is the step to reach, not how many to add; "
            f"fix: e.g. --steps {resume.step + 100} to train 100 more steps")
    return config, resume, problems
