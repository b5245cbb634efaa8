"""What trains the weights in ``pipetrain train``: the optimizer and the LR schedule.

The options (``--optimizer``, ``--weight-decay``, ``--betas``, ``--momentum``,
``--lr-schedule``, ``--min-lr``, ``--warmup``; :mod:`pipetrain.api.optimizers`,
:mod:`pipetrain.api.lr_schedule`) make them, unless a model file returns its own
``optimizer`` / ``lr_scheduler`` factory (:mod:`.user_models`); ``config.json`` records
which ran (:func:`optimizer_record`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipetrain.api.lr_schedule import lr_factor
from pipetrain.api.optimizers import default_weight_decay, make_optimizer
from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.train_options import flag
from pipetrain.cli.worker_errors import UsageError

__all__ = ["honour_options", "optimizer_record", "run_lr_factor", "training_factories"]

_OPTIMIZER_OPTIONS = ("optimizer", "lr", "weight_decay", "betas", "momentum")
_SCHEDULE_OPTIONS = ("lr_schedule", "min_lr", "warmup")


def training_factories(args: RunConfig,
                       model_arguments: dict[str, Any]) -> tuple[Any, Any, dict[str, bool]]:
    """The optimizer and LR-scheduler factories: a model file's (taken out of
    ``model_arguments``), else the options'; and which came from the model file
    (``{"optimizer": ..., "lr_scheduler": ...}``). Options given beside a model file's
    factory are refused: they would not run."""
    from_file = {key: key in model_arguments for key in ("optimizer", "lr_scheduler")}
    optimizer = model_arguments.pop("optimizer", None)
    scheduler = model_arguments.pop("lr_scheduler", None)
    for factory, names, key in ((optimizer, _OPTIMIZER_OPTIONS, "optimizer"),
                                (scheduler, _SCHEDULE_OPTIONS, "lr_scheduler")):
        given = [flag(name, getattr(args, name)).split()[0] for name in names if args.given(name)]
        if factory is not None and given:
            raise UsageError([f"{', '.join(given)} and the {key!r} the model file returns "
                              f"both set the {key.replace('_', ' ')}; fix: leave out "
                              f"{', '.join(given)}, or the model file's {key!r}"])
    if optimizer is None:
        def optimizer(params: Any) -> torch.optim.Optimizer:
            return make_optimizer(args.optimizer, params, lr=args.lr,
                                  weight_decay=args.weight_decay,
                                  betas=(args.betas[0], args.betas[1]), momentum=args.momentum)
    if scheduler is None:
        def scheduler(opt: torch.optim.Optimizer) -> Any:
            return torch.optim.lr_scheduler.LambdaLR(opt, run_lr_factor(args))
    return optimizer, scheduler, from_file


def run_lr_factor(args: RunConfig) -> Callable[[int], float]:
    """The run's learning-rate multiplier per step: ``--warmup``, ``--lr-schedule`` down to
    ``--min-lr`` (``--lr`` / 10 unless given) at ``--steps``."""
    low = args.lr / 10 if args.min_lr is None else args.min_lr
    return lr_factor(args.warmup, args.steps, schedule=args.lr_schedule,
                     min_ratio=min(1.0, low / args.lr))


def honour_options(pipe: Any, args: RunConfig) -> None:
    """After a resume's load: ``--lr``, its schedule and the optimizer's settings over
    the checkpoint's (each stage's optimizer and scheduler)."""
    settings = {"weight_decay": (default_weight_decay(args.optimizer)
                                 if args.weight_decay is None else args.weight_decay),
                "betas": tuple(args.betas), "momentum": args.momentum}
    for j, optimizer in pipe.optimizers.optimizers.items():
        scheduler = pipe.optimizers.schedulers[j]
        factor = run_lr_factor(args)(scheduler.last_epoch)
        scheduler.base_lrs = [args.lr for _ in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["initial_lr"] = args.lr
            group["lr"] = args.lr * factor
            group.update({k: v for k, v in settings.items() if k in group})


def optimizer_record(pipe: Any, from_file: dict[str, bool]) -> dict[str, Any]:
    """What trains the weights, for ``config.json``: the optimizer's and the LR
    scheduler's classes, the optimizer's settings, and where each came from.

    Example::

        optimizer_record(pipe, {"optimizer": False, "lr_scheduler": False})
        # {'class': 'AdamW', 'settings': {'lr': 0.01, 'betas': [0.9, 0.95], ...},
        #  'source': 'the options', 'lr_scheduler': 'LambdaLR', ...}
    """
    stage, optimizer = next(iter(pipe.optimizers.optimizers.items()))
    scheduler = pipe.optimizers.schedulers.get(stage)
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in optimizer.defaults.items()
                if isinstance(v, (int, float, str, bool, tuple))}
    where = {True: "the model file", False: "the options"}
    return {"class": type(optimizer).__name__, "settings": settings,
            "source": where[from_file["optimizer"]],
            "lr_scheduler": None if scheduler is None else type(scheduler).__name__,
            "lr_scheduler_source": where[from_file["lr_scheduler"]]}
