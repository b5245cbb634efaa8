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
:mod:`.checkpoint_files`). A load verifies the newest checkpoint once (rank 0 reads every
file against its checksum) and falls back to the newest intact one, setting the damaged
ones aside with a warning naming the damaged file. A failed save or load ends in one line
(:class:`CheckpointError`): a full disk says so, with the path and the space.

Nothing in a checkpoint runs code when it is loaded: pipetrain's own entry is JSON (so
``extra`` must be JSON), and DCP's index and non-tensor entries are read through the
restricted readers of :mod:`.checkpoint_reader`. The files are created with the user's
umask (``umask 077`` makes them private).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
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
    set_aside,
    write_manifest,
)
from pipetrain.api.checkpoint_reader import (
    SafeLoadPlanner,
    SafeReader,
    decode_meta,
    encode_meta,
    read_index,
    read_meta,
)

__all__ = [
    "KEEP",
    "CheckpointError",
    "Checkpointable",
    "Loaded",
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


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_pipeline` loaded."""

    path: str
    """The checkpoint folder read (the newest intact one)."""
    step: int
    extra: dict[str, Any] | None
    """The ``extra`` saved with it."""
    passed_over: tuple[str, ...] = ()
    """One line for each damaged newer checkpoint passed over (and set aside)."""


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
        "meta": encode_meta(
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
    folder = os.path.dirname(os.path.abspath(partial))
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
    if _disk_full(error) or free < local_bytes:
        return CheckpointError(
            f"saving the checkpoint failed: no space left on the device of {partial!r} "
            f"(this rank's share of the checkpoint is about {local_bytes / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB are free there); {kept}. Fix: free space there or "
            "save on another disk")
    first = next((f for f in _failures(error) if not isinstance(f, CheckpointException)), error)
    text = " ".join(str(first).split())[:300]
    return CheckpointError(f"saving the checkpoint to {partial!r} failed: "
                           f"{type(first).__name__}: {text}; {kept}")


def _disk_full(error: BaseException) -> bool:
    """Whether a failed save ran out of space: ENOSPC / EDQUOT, or torch's stream writer
    finding its file shorter than what it wrote ("unexpected pos")."""
    for failure in _failures(error):
        if isinstance(failure, OSError) and failure.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "unexpected pos" in str(failure) or "failed writing file" in str(failure):
            return True
    return False


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
    except (CheckpointException, OSError, RuntimeError) as error:
        failure = _save_error(error, partial=partial, path=path, local_bytes=_state_bytes(state))
        if dist.get_rank() == 0 and _communication_error(error) is None:
            _remove(partial)  # a failed save's files only take space
        raise failure from None
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


def load_pipeline(pipeline: Checkpointable, path: str | os.PathLike[str], *,
                  set_aside: bool = True) -> Loaded:
    """Load a checkpoint saved by :func:`save_pipeline` (any layout).

    Reads the newest intact checkpoint kept at ``path``: rank 0 verifies it (every file
    against its checksum: once for the job) and passes over a damaged newer one (a
    truncated, missing or changed file, a missing or invalid manifest, an index holding
    objects a checkpoint does not) with a warning naming the file; with ``set_aside``
    the damaged ones are renamed ``PATH.damaged-step-S`` so that later saves never count
    them as kept (pass ``False`` where another job may be writing ``path``).

    Raises:
        FileNotFoundError: ``path`` holds no checkpoint, or none intact (the message
            names each and what is wrong with it).
        CheckpointError: reading it failed.

    Example (every rank)::

        loaded = load_pipeline(pipe, "runs/demo/checkpoint")
        loaded.step, loaded.extra
    """
    joined = dist.is_initialized() and dist.get_world_size() > 1
    chosen: list[Any] = [None]
    if not joined or dist.get_rank() == 0:
        try:
            chosen[0] = _intact(path, aside=set_aside)
        except FileNotFoundError as error:
            chosen[0] = error
    if joined:
        dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], FileNotFoundError):
        raise FileNotFoundError(str(chosen[0]))
    found, passed_over = chosen[0]
    state = _state(pipeline, None)
    asynchronous = getattr(pipeline, "async_state", None)
    names = _names(pipeline)
    if asynchronous is not None:  # 2BW's previous version, where the checkpoint has one
        saved = set(read_index(found).state_dict_metadata)
        state["stash"] = {name: torch.empty_like(p.detach()) for name, p in
                          pipeline.model.named_parameters() if f"stash.{name}" in saved}
        if not state["stash"]:
            del state["stash"]
    try:
        dcp_load(state, storage_reader=SafeReader(found), planner=SafeLoadPlanner())
    except CheckpointException as error:
        broken = _communication_error(error)
        if broken is not None:
            raise broken from None
        first = next((f for f in _failures(error) if not isinstance(f, CheckpointException)), error)
        raise CheckpointError(f"loading the checkpoint {found!r} failed: {type(first).__name__}: "
                              f"{' '.join(str(first).split())[:300]}") from None
    pipeline.model.load_state_dict(state["model"])
    optimizers = list(pipeline.optimizers.optimizers.values())
    set_optimizer_state_dict(pipeline.model, optimizers, state["optim"], options=_OPTIONS)
    meta = decode_meta(state["meta"])
    pipeline.step = int(meta["step"])
    if meta.get("scheduler") is not None:
        for scheduler in pipeline.optimizers.schedulers.values():
            scheduler.load_state_dict(meta["scheduler"])
    scaler = getattr(pipeline.optimizers, "scaler", None)
    if meta.get("loss_scale") is not None and scaler is not None:
        scaler.load_state_dict(meta["loss_scale"])
    if asynchronous is not None:
        asynchronous.restore(meta.get("async"), state.get("stash", {}), names, step=pipeline.step)
    return Loaded(path=found, step=pipeline.step, extra=meta.get("extra"),
                  passed_over=tuple(passed_over))


def _intact(path: str | os.PathLike[str], *, aside: bool) -> tuple[str, list[str]]:
    """The newest intact checkpoint kept at ``path`` and a line for each damaged newer
    one (logged as a warning; with ``aside``, set aside)."""
    found, damaged = find_intact(path)
    if found is None:
        if damaged:
            listed = "; ".join(f"{c.path}: {problem}" for c, problem in damaged)
            raise FileNotFoundError(
                f"no intact pipetrain checkpoint in {os.fspath(path)!r}: {listed}. Fix: restore "
                "the damaged files, or start over without --resume")
        raise FileNotFoundError(
            f"no pipetrain checkpoint in {os.fspath(path)!r} (no .metadata file); fix: pass the "
            "checkpoint directory written by Pipeline.save / `pipetrain train --out DIR` "
            "(DIR/checkpoint)")
    notes = []
    for candidate, problem in damaged:
        note = f"checkpoint {candidate.path} (step {candidate.step}) is damaged: {problem}"
        if aside:
            note += f"; set aside as {set_aside(os.fspath(path), candidate)}"
        notes.append(f"{note}; using {found.path} (step {found.step})")
        logger.warning("%s", notes[-1])
    return found.path, notes


def read_checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The step and ``extra`` of the newest intact checkpoint at ``path``, read in this
    process alone (no job needed; only the small metadata entry is read; nothing is
    set aside).

    Raises:
        FileNotFoundError: ``path`` holds no intact checkpoint.

    Example::

        read_checkpoint_info("runs/demo/checkpoint")   # {'step': 1000, 'extra': {...}}
    """
    found, _ = _intact(path, aside=False)
    meta = read_meta(found)
    return {"step": int(meta["step"]), "extra": meta.get("extra"), "path": found}
