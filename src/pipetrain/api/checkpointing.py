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

A save is atomic and keeps the previous checkpoints: it is written to ``PATH.partial``,
checksummed into a manifest, and renamed over ``PATH`` only when every rank has finished;
the checkpoint it replaces stays as ``PATH.step-S`` (``keep`` checkpoints in all, see
:mod:`.checkpoint_files`). A load verifies the newest checkpoint and falls back to the
newest intact one, with a warning naming the damaged file. A failed save or load ends
in one line (:class:`CheckpointError`): a full disk says so, with the path and the space.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import shutil
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from pipetrain.api.checkpoint_files import (
    checkpoint_problem,
    commit,
    find_checkpoint,
    find_intact,
    is_complete,
    read_meta,
    write_manifest,
)

__all__ = [
    "KEEP",
    "CheckpointError",
    "Checkpointable",
    "checkpoint_problem",
    "find_checkpoint",
    "is_complete",
    "load_pipeline",
    "read_checkpoint_info",
    "save_pipeline",
]

logger = logging.getLogger(__name__)

KEEP = 2
"""Checkpoints a save keeps by default: the new one and the one before it."""


class CheckpointError(RuntimeError):
    """Saving or loading a checkpoint failed; the message names the path, the cause and
    what was kept (one line)."""


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


def _state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return int(state.numel() * state.element_size())
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return len(state) if isinstance(state, bytes) else 0


def _failures(error: BaseException) -> list[BaseException]:
    """The underlying errors of a DCP failure (each rank's), their causes included."""
    found: list[BaseException] = []
    roots = [pair[0] for pair in error.failures.values()] if isinstance(error, CheckpointException) else [error]
    for root in roots:
        seen: BaseException | None = root
        while seen is not None and seen not in found:
            found.append(seen)
            seen = seen.__cause__ or seen.__context__
    return found


def _communication_error(error: BaseException) -> RuntimeError | None:
    from pipetrain.runtime.monitor import is_communication_error

    for failure in _failures(error):
        if isinstance(failure, RuntimeError) and is_communication_error(failure):
            return failure
    return None


def _save_error(error: BaseException, *, partial: str, path: str, local_bytes: int) -> BaseException:
    """The one-line error of a failed save (a peer's failure stays a communication error,
    which the pipeline's guard names)."""
    broken = _communication_error(error)
    if broken is not None:
        return broken
    kept = ("the previous checkpoint is kept" if find_checkpoint(path, checksums=False)
            else "no earlier checkpoint existed")
    for failure in _failures(error):
        if isinstance(failure, OSError) and failure.errno in (errno.ENOSPC, errno.EDQUOT):
            folder = os.path.dirname(os.path.abspath(partial))
            free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
            return CheckpointError(
                f"saving the checkpoint failed: no space left on the device of {partial!r} "
                f"(this rank's share of the checkpoint is about {local_bytes / 2**20:.1f} MiB, "
                f"{free / 2**20:.1f} MiB are free there); {kept}. Fix: free space there or "
                "save on another disk")
    first = next((f for f in _failures(error) if not isinstance(f, CheckpointException)), error)
    text = " ".join(str(first).split())[:300]
    return CheckpointError(f"saving the checkpoint to {partial!r} failed: "
                           f"{type(first).__name__}: {text}; {kept}")


def save_pipeline(pipeline: Checkpointable, path: str | os.PathLike[str], *,
                  extra: dict[str, Any] | None = None, keep: int = KEEP) -> None:
    """Save ``pipeline`` (all ranks call this) to the directory ``path``, keeping the
    ``keep`` newest checkpoints (the one replaced stays as ``path.step-S``).

    ``extra`` must be the same on every rank (e.g. the data position).

    Raises:
        CheckpointError: the save failed (a full disk, an unwritable folder); the
            earlier checkpoints are kept.

    Example (every rank)::

        save_pipeline(pipe, "runs/demo/checkpoint", extra={"epoch": 3})
    """
    if keep < 1:
        raise ValueError(f"keep={keep!r} must be at least 1 (the newest checkpoint)")
    path = os.fspath(path)
    partial = path + ".partial"
    if dist.get_rank() == 0 and os.path.lexists(partial):
        newest = find_checkpoint(path, checksums=False)
        if newest == partial:
            commit(partial, path, keep=keep)  # an earlier save finished writing but not renaming
        else:
            _remove(partial)
    dist.barrier()
    state = _state(pipeline, extra)
    try:
        dcp_save(state, checkpoint_id=partial)
    except (CheckpointException, OSError) as error:
        if dist.get_rank() == 0 and _communication_error(error) is None:
            _remove(partial)  # a failed save's files only take space
        raise _save_error(error, partial=partial, path=path,
                          local_bytes=_state_bytes(state)) from None
    dist.barrier()
    write_manifest(partial, step=pipeline.step)
    if dist.get_rank() == 0:
        commit(partial, path, keep=keep)
    dist.barrier()


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def load_pipeline(pipeline: Checkpointable, path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Load a checkpoint saved by :func:`save_pipeline` (any layout); returns ``extra``.

    Reads the newest intact checkpoint kept at ``path``: a damaged newer one (a
    truncated or missing shard, an unreadable index, a checksum that does not match) is
    passed over with a warning naming the file (see :func:`find_intact`).

    Raises:
        FileNotFoundError: ``path`` holds no checkpoint, or none intact (the message
            names each and what is wrong with it).
        CheckpointError: reading it failed.

    Example (every rank)::

        extra = load_pipeline(pipe, "runs/demo/checkpoint")
    """
    path = _intact(path)
    state = _state(pipeline, None)
    asynchronous = getattr(pipeline, "async_state", None)
    names = _names(pipeline)
    if asynchronous is not None:  # 2BW's previous version, where the checkpoint has one
        saved = set(FileSystemReader(path).read_metadata().state_dict_metadata)
        state["stash"] = {name: torch.empty_like(p.detach()) for name, p in
                          pipeline.model.named_parameters() if f"stash.{name}" in saved}
        if not state["stash"]:
            del state["stash"]
    try:
        dcp_load(state, checkpoint_id=path)
    except CheckpointException as error:
        broken = _communication_error(error)
        if broken is not None:
            raise broken from None
        first = next((f for f in _failures(error) if not isinstance(f, CheckpointException)), error)
        raise CheckpointError(f"loading the checkpoint {path!r} failed: {type(first).__name__}: "
                              f"{' '.join(str(first).split())[:300]}") from None
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


def _intact(path: str | os.PathLike[str]) -> str:
    """The newest intact checkpoint kept at ``path``, warning about damaged newer ones."""
    found, damaged = find_intact(path)
    for candidate, problem in damaged:
        if found is not None:
            logger.warning("checkpoint %s (step %s) is damaged: %s; using %s (step %s) instead",
                           candidate.path, candidate.step, problem, found.path, found.step)
    if found is not None:
        return found.path
    if damaged:
        listed = "; ".join(f"{c.path}: {problem}" for c, problem in damaged)
        raise FileNotFoundError(
            f"no intact pipetrain checkpoint in {os.fspath(path)!r}: {listed}. Fix: restore the "
            "damaged files, or start over without --resume")
    raise FileNotFoundError(
        f"no pipetrain checkpoint in {os.fspath(path)!r} (no .metadata file); fix: pass the "
        "checkpoint directory written by Pipeline.save / `pipetrain train --out DIR` "
        "(DIR/checkpoint)")


def read_checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The step and ``extra`` of the newest intact checkpoint at ``path``, read in this
    process alone (no job needed; only the small metadata entry is read).

    Raises:
        FileNotFoundError: ``path`` holds no intact checkpoint.

    Example::

        read_checkpoint_info("runs/demo/checkpoint")   # {'step': 1000, 'extra': {...}}
    """
    found = _intact(path)
    meta = read_meta(found)
    return {"step": int(meta["step"]), "extra": meta.get("extra"), "path": found}
