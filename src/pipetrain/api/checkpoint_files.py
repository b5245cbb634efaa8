"""The files of a checkpoint on disk: the copies kept, their manifest, and whether one is intact.

A checkpoint at ``PATH`` is a torch.distributed.checkpoint folder. A save writes
``PATH.partial`` and then, once every rank has written its shards and the manifest,
renames it to ``PATH``; the checkpoint it replaces becomes ``PATH.step-S`` (``S`` its
step), and only the newest ``keep`` checkpoints stay (``keep=2``: ``PATH`` and one
older). At every moment a complete checkpoint exists under one of these names.

The manifest (``pipetrain-manifest.json`` in the folder) holds the step and every
file's size and CRC-32, computed right after the save (each rank checksums a share of
the files). :func:`checkpoint_problem` checks a checkpoint against its index (DCP's
``.metadata``: every file it needs is there and long enough) and against its manifest;
:func:`find_intact` returns the newest intact checkpoint among the kept ones and says
which newer ones are damaged and why, so a resume falls back instead of failing.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import re
import shutil
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

__all__ = [
    "MANIFEST",
    "Candidate",
    "checkpoint_problem",
    "commit",
    "find_checkpoint",
    "find_intact",
    "is_complete",
    "kept_checkpoints",
    "read_meta",
    "write_manifest",
]

MANIFEST = "pipetrain-manifest.json"
"""The manifest's file name inside a checkpoint folder."""
_METADATA = ".metadata"
_CHUNK = 16 << 20
_STEP = re.compile(r"\.step-(\d+)$")


@dataclass(frozen=True)
class Candidate:
    """A checkpoint folder that may hold the run's newest intact state."""

    path: str
    step: int | None
    """Its step (``None``: unreadable)."""


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a finished checkpoint (DCP writes ``.metadata`` last).

    Example:
        >>> is_complete("/nonexistent/checkpoint")
        False
    """
    return os.path.isfile(os.path.join(os.fspath(path), _METADATA))


def _crc32(path: str) -> int:
    value = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def _manifest(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as file:
            value = json.load(file)
    except FileNotFoundError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("files"), dict):
        raise ValueError("not a pipetrain manifest")
    return value


def read_meta(path: str) -> dict[str, Any]:
    """The pipeline's own entry of the checkpoint at ``path`` (step, schedulers, extra),
    read in this process alone."""
    state: dict[str, Any] = {"meta": b""}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(state, checkpoint_id=path)
    meta: dict[str, Any] = pickle.loads(state["meta"])
    return meta


def _step(path: str) -> int | None:
    try:
        manifest = _manifest(path)
        if manifest is not None and isinstance(manifest.get("step"), int):
            return int(manifest["step"])
        return int(read_meta(path)["step"])
    except Exception:
        return None


def checkpoint_problem(path: str | os.PathLike[str], *, checksums: bool = True) -> str | None:
    """What is wrong with the checkpoint at ``path`` (one phrase naming the file), or
    ``None`` if it is intact: its index readable, every file it needs present and long
    enough, and (with ``checksums``, where a manifest exists) every file's CRC-32 as saved.

    Example:
        >>> checkpoint_problem("/nonexistent/checkpoint")
        'no .metadata (an unfinished save)'
    """
    path = os.fspath(path)
    if not is_complete(path):
        return f"no {_METADATA} (an unfinished save)"
    try:
        index = FileSystemReader(path).read_metadata()
        needed: dict[str, int] = {}
        for item in dict(index.storage_data or {}).values():
            name = str(item.relative_path)
            needed[name] = max(needed.get(name, 0), int(item.offset) + int(item.length))
    except Exception as error:
        return f"{_METADATA} is unreadable ({type(error).__name__}: {str(error)[:120]})"
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        have = os.path.getsize(file)
        if have < size:
            return f"{name} is {have:,} bytes but the checkpoint's index needs {size:,} (truncated)"
    try:
        manifest = _manifest(path)
    except (OSError, ValueError) as error:
        return f"{MANIFEST} is unreadable ({error})"
    if manifest is None or not checksums:
        return None
    for name, entry in sorted(manifest["files"].items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != entry["bytes"]:
            return f"{name} is {os.path.getsize(file):,} bytes, saved as {entry['bytes']:,}"
        if _crc32(file) != entry["crc32"]:
            return f"{name} does not match its checksum (changed or damaged since the save)"
    return None


def kept_checkpoints(path: str | os.PathLike[str]) -> list[Candidate]:
    """Every checkpoint kept at ``path``, newest first: ``path`` and ``path.step-S`` (even
    unfinished: that is damage), a complete ``path.partial`` (written, not yet renamed)
    and a complete ``path.previous`` of earlier versions. At equal steps ``path`` comes
    first.

    Example:
        >>> kept_checkpoints("/nonexistent/checkpoint")
        []
    """
    path = os.fspath(path)
    kept = [path, *sorted(glob.glob(glob.escape(path) + ".step-*"))]
    names = [kept[0], path + ".partial", *kept[1:], path + ".previous"]
    found = [Candidate(name, _step(name)) for name in names
             if is_complete(name) or (name in kept and os.path.isdir(name))]
    rank = {name: i for i, name in enumerate(names)}
    return sorted(found, key=lambda c: (-(c.step if c.step is not None else -1), rank[c.path]))


def find_intact(path: str | os.PathLike[str], *,
                checksums: bool = True) -> tuple[Candidate | None, list[tuple[Candidate, str]]]:
    """The newest intact checkpoint kept at ``path`` (or ``None``), and the newer ones
    passed over with what is wrong with each.

    Example:
        >>> find_intact("/nonexistent/checkpoint")
        (None, [])
    """
    damaged: list[tuple[Candidate, str]] = []
    for candidate in kept_checkpoints(path):
        problem = checkpoint_problem(candidate.path, checksums=checksums)
        if problem is None:
            return candidate, damaged
        damaged.append((candidate, problem))
    return None, damaged


def find_checkpoint(path: str | os.PathLike[str], *, checksums: bool = True) -> str | None:
    """The folder of the newest intact checkpoint kept at ``path``, or ``None``.

    Example:
        >>> find_checkpoint("/nonexistent/checkpoint") is None
        True
    """
    found, _ = find_intact(path, checksums=checksums)
    return None if found is None else found.path


def write_manifest(folder: str, *, step: int, group: Any = None) -> None:
    """Write ``folder``'s manifest (every rank of ``group`` calls it after the save: each
    checksums a share of the files, rank 0 writes it; outside a job, this process alone).

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "shard"), "wb").write(b"weights")
        >>> write_manifest(folder, step=3)
        >>> json.load(open(os.path.join(folder, MANIFEST)))["files"]["shard"]["bytes"]
        7
    """
    joined = dist.is_initialized()
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if joined else (1, 0)
    names = sorted(n for n in os.listdir(folder) if n != MANIFEST and not n.endswith(".tmp"))
    mine = {n: {"bytes": os.path.getsize(os.path.join(folder, n)),
                "crc32": _crc32(os.path.join(folder, n))} for n in names[rank::world]}
    shares: list[Any] = [mine]
    if joined and world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, mine, group=group)
    if rank == 0:
        files = {name: entry for share in shares for name, entry in share.items()}
        temporary = os.path.join(folder, MANIFEST + ".tmp")
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump({"step": step, "files": files}, file, indent=1, sort_keys=True)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, os.path.join(folder, MANIFEST))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def commit(partial: str, path: str, *, keep: int) -> None:
    """Put the finished checkpoint ``partial`` in place of ``path``, keep the checkpoint
    it replaces as ``path.step-S``, and remove all but the newest ``keep`` (rank 0 only).

    At every moment a complete checkpoint exists under one of the kept names.
    """
    if keep < 1:
        raise ValueError(f"keep={keep!r} must be at least 1 (the newest checkpoint)")
    legacy = path + ".previous"  # an earlier version's name for the checkpoint replaced
    if is_complete(legacy) and (step := _step(legacy)) is not None:
        if not os.path.lexists(f"{path}.step-{step}"):
            os.replace(legacy, f"{path}.step-{step}")
    if os.path.lexists(path):
        if is_complete(path):
            step = _step(path)
            aside = f"{path}.step-{step}" if step is not None else f"{path}.damaged"
        else:
            aside = f"{path}.damaged"  # not a checkpoint: kept aside, never counted
        _remove(aside)
        os.replace(path, aside)
    os.replace(partial, path)
    older = [c for c in kept_checkpoints(path) if c.path not in (path, partial)]
    for candidate in older[keep - 1:]:
        _remove(candidate.path)
    if not is_complete(path + ".previous"):
        _remove(path + ".previous")  # an earlier version's cleanup that was cut short
