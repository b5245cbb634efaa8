"""Saving and loading a pipeline with torch.distributed.checkpoint, sharded per stage.

Every rank writes the parameters and optimizer state of its own stages under their
global names (``layers.5.weight``), so a checkpoint taken with K stages loads into a
run with any other number of stages or replicas. The step, the LR schedulers and the
caller's extra state (data position, ...) travel with it. Random streams are a function
of (seed, step), so restoring the step restores them.

A save is atomic: it is written to ``PATH.partial`` and renamed over ``PATH`` only when
every rank has finished, so an interrupted save never destroys the previous checkpoint.
"""

from __future__ import annotations

import os
import pickle
import shutil
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

if TYPE_CHECKING:
    from pipetrain.api.pipeline import Pipeline

__all__ = ["load_pipeline", "save_pipeline"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(pipeline: Pipeline, extra: dict[str, Any] | None) -> dict[str, Any]:
    optimizers = list(pipeline.optimizers.optimizers.values())
    schedulers = pipeline.optimizers.schedulers
    return {
        "model": pipeline.model.state_dict(),
        "optim": get_optimizer_state_dict(pipeline.model, optimizers, options=_OPTIONS),
        # one opaque leaf: DCP would flatten a dict and then demand the same keys on load
        "meta": pickle.dumps(
            {
                "step": pipeline.step,
                "scheduler": next(iter(schedulers.values())).state_dict() if schedulers else None,
                "extra": extra,
            }
        ),
    }


def save_pipeline(pipeline: Pipeline, path: str | os.PathLike[str], *, extra: dict[str, Any] | None = None) -> None:
    """Save ``pipeline`` (all ranks call this) to the directory ``path``.

    ``extra`` must be the same on every rank (e.g. the data position).

    Example (every rank)::

        save_pipeline(pipe, "runs/demo/checkpoint", extra={"epoch": 3})
    """
    path = os.fspath(path)
    partial = path + ".partial"
    if dist.get_rank() == 0 and os.path.exists(partial):
        shutil.rmtree(partial)
    dist.barrier()
    dcp_save(_state(pipeline, extra), checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        previous = path + ".previous"
        if os.path.exists(path):
            os.replace(path, previous)
        os.replace(partial, path)
        if os.path.exists(previous):
            shutil.rmtree(previous)
    dist.barrier()


def load_pipeline(pipeline: Pipeline, path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Load a checkpoint saved by :func:`save_pipeline` (any layout); returns ``extra``.

    Raises:
        FileNotFoundError: ``path`` holds no checkpoint (the message names it).

    Example (every rank)::

        extra = load_pipeline(pipe, "runs/demo/checkpoint")
    """
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(
            f"no pipetrain checkpoint in {path!r} (no .metadata file); fix: pass the "
            "checkpoint directory written by Pipeline.save / `pipetrain train --out DIR` "
            "(DIR/checkpoint)"
        )
    state = _state(pipeline, None)
    dcp_load(state, checkpoint_id=path)
    pipeline.model.load_state_dict(state["model"])
    optimizers = list(pipeline.optimizers.optimizers.values())
    set_optimizer_state_dict(pipeline.model, optimizers, state["optim"], options=_OPTIONS)
    meta = pickle.loads(state["meta"])
    pipeline.step = int(meta["step"])
    if meta.get("scheduler") is not None:
        for scheduler in pipeline.optimizers.schedulers.values():
            scheduler.load_state_dict(meta["scheduler"])
    extra: dict[str, Any] | None = meta.get("extra")
    return extra
