"""Saving and loading a pipeline with torch.distributed.checkpoint, sharded per stage.

Every rank writes the parameters and optimizer state of its own stages under their
global names (``layers.5.weight``), so a checkpoint taken with K stages loads into a
run with any other number of stages or replicas. The step, the LR schedulers, fp16's
loss scale and the caller's extra state (data position, ...) travel with it. Random streams are a function
of (seed, step), so restoring the step restores them.

An asynchronous schedule's pipeline is drained before a save (``Pipeline.save`` does it),
so nothing is in flight; the checkpoint records how many micro-batches and steps ran
(their numbering continues, and with it the weight versions and random streams) and, for
2BW, the previous weight version the next step computes with (``stash.<name>``).

A save is atomic: it is written to ``PATH.partial`` and renamed over ``PATH`` only when
every rank has finished, so an interrupted save never destroys the previous checkpoint.
A save also survives whatever an earlier interrupted save left behind (a stale
``PATH.partial``, a half-deleted ``PATH.previous``, or ``PATH`` missing between the two
renames), and a load finds the newest complete checkpoint among them
(:func:`find_checkpoint`).
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

__all__ = [
    "Checkpointable",
    "find_checkpoint",
    "is_complete",
    "load_pipeline",
    "read_checkpoint_info",
    "save_pipeline",
]


class Checkpointable(Protocol):
    """What a checkpoint holds of a pipeline: its model (this rank's layers), its stage
    optimizers and schedulers, and its step (:class:`~pipetrain.api.pipeline.Pipeline`)."""

    model: Any
    optimizers: Any
    step: int

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _names(pipeline: Checkpointable) -> dict[int, str]:
    return {id(p): name for name, p in pipeline.model.named_parameters(remove_duplicate=False)}


def _state(pipeline: Checkpointable, extra: dict[str, Any] | None) -> dict[str, Any]:
    optimizers = list(pipeline.optimizers.optimizers.values())
    schedulers = pipeline.optimizers.schedulers
    scaler = getattr(pipeline.optimizers, "scaler", None)
    asynchronous = getattr(pipeline, "async_state", None)
    state = {
        "model": pipeline.model.state_dict(),
        "optim": get_optimizer_state_dict(pipeline.model, optimizers, options=_OPTIONS),
        # one opaque leaf: DCP would flatten a dict and then demand the same keys on load
        "meta": pickle.dumps(
            {
                "step": pipeline.step,
                "scheduler": next(iter(schedulers.values())).state_dict() if schedulers else None,
                "loss_scale": scaler.state_dict() if scaler is not None else None,
                "extra": extra,
                "async": asynchronous.meta() if asynchronous is not None else None,
            }
        ),
    }
    stash = asynchronous.tensors(_names(pipeline)) if asynchronous is not None else {}
    if stash:
        state["stash"] = stash
    return state


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a complete checkpoint (DCP writes ``.metadata`` last).

    Example:
        >>> is_complete("/nonexistent/checkpoint")
        False
    """
    return os.path.isfile(os.path.join(os.fspath(path), ".metadata"))


def find_checkpoint(path: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint at ``path``, looking at what an interrupted save
    may have left: ``path`` itself, else ``path.partial`` (written completely but not
    yet renamed), else ``path.previous`` (renamed away, the new one not yet in place).

    Example:
        >>> find_checkpoint("/nonexistent/checkpoint") is None
        True
    """
    path = os.fspath(path)
    for candidate in (path, path + ".partial", path + ".previous"):
        if is_complete(candidate):
            return candidate
    return None


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _commit(partial: str, path: str) -> None:
    """Put the complete checkpoint ``partial`` in place of ``path`` (rank 0 only).

    At every moment a complete checkpoint exists under ``path``, ``path.partial`` or
    ``path.previous``; leftovers of an interrupted earlier save are cleared first,
    keeping the one complete checkpoint among them.
    """
    previous = path + ".previous"
    if os.path.lexists(previous):
        if is_complete(path) or not is_complete(previous):
            _remove(previous)  # a cleanup that was cut short
        elif os.path.lexists(path):
            _remove(path)  # incomplete; the previous one is the last good checkpoint
    if os.path.lexists(path):
        os.replace(path, previous)
    os.replace(partial, path)
    if os.path.lexists(previous):
        _remove(previous)


def save_pipeline(pipeline: Checkpointable, path: str | os.PathLike[str], *, extra: dict[str, Any] | None = None) -> None:
    """Save ``pipeline`` (all ranks call this) to the directory ``path``.

    ``extra`` must be the same on every rank (e.g. the data position).

    Example (every rank)::

        save_pipeline(pipe, "runs/demo/checkpoint", extra={"epoch": 3})
    """
    path = os.fspath(path)
    partial = path + ".partial"
    if dist.get_rank() == 0 and os.path.lexists(partial):
        if not is_complete(path) and is_complete(partial):
            _commit(partial, path)  # an earlier save finished writing but not renaming
        else:
            _remove(partial)
    dist.barrier()
    dcp_save(_state(pipeline, extra), checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        _commit(partial, path)
    dist.barrier()


def load_pipeline(pipeline: Checkpointable, path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Load a checkpoint saved by :func:`save_pipeline` (any layout); returns ``extra``.

    Reads the newest complete checkpoint at ``path`` (see :func:`find_checkpoint`).

    Raises:
        FileNotFoundError: ``path`` holds no checkpoint (the message names it).

    Example (every rank)::

        extra = load_pipeline(pipe, "runs/demo/checkpoint")
    """
    found = find_checkpoint(path)
    if found is None:
        raise FileNotFoundError(
            f"no pipetrain checkpoint in {os.fspath(path)!r} (no .metadata file); fix: pass the "
            "checkpoint directory written by Pipeline.save / `pipetrain train --out DIR` "
            "(DIR/checkpoint)"
        )
    path = found
    state = _state(pipeline, None)
    asynchronous = getattr(pipeline, "async_state", None)
    names = _names(pipeline)
    if asynchronous is not None:  # 2BW's previous version, where the checkpoint has one
        saved = set(FileSystemReader(path).read_metadata().state_dict_metadata)
        state["stash"] = {name: torch.empty_like(p.detach()) for name, p in
                          pipeline.model.named_parameters() if f"stash.{name}" in saved}
        if not state["stash"]:
            del state["stash"]
    dcp_load(state, checkpoint_id=path)
    pipeline.model.load_state_dict(state["model"])
    optimizers = list(pipeline.optimizers.optimizers.values())
    set_optimizer_state_dict(pipeline.model, optimizers, state["optim"], options=_OPTIONS)
    meta = pickle.loads(state["meta"])
    pipeline.step = int(meta["step"])
    if meta.get("scheduler") is not None:
        for scheduler in pipeline.optimizers.schedulers.values():
            scheduler.load_state_dict(meta["scheduler"])
    scaler = getattr(pipeline.optimizers, "scaler", None)
    if meta.get("loss_scale") is not None and scaler is not None:
        scaler.load_state_dict(meta["loss_scale"])
    if asynchronous is not None:
        asynchronous.restore(meta.get("async"), state.get("stash", {}), names, step=pipeline.step)
    extra: dict[str, Any] | None = meta.get("extra")
    return extra


def read_checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The step and ``extra`` of the newest complete checkpoint at ``path``, read in this
    process alone (no job needed; only the small metadata entry is read).

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint.

    Example::

        read_checkpoint_info("runs/demo/checkpoint")   # {'step': 1000, 'extra': {...}}
    """
    found = find_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"no pipetrain checkpoint in {os.fspath(path)!r} (no .metadata file)")
    state: dict[str, Any] = {"meta": b""}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(state, checkpoint_id=found)
    meta = pickle.loads(state["meta"])
    return {"step": int(meta["step"]), "extra": meta.get("extra"), "path": found}
