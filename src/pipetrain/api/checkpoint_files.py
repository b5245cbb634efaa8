"""The files of a checkpoint on disk: the copies kept, their manifest, and whether one is intact.

A checkpoint at ``PATH`` is a torch.distributed.checkpoint folder. A save writes
``PATH.partial`` and then, once every rank has written its shards and the manifest,
renames it to ``PATH``; the checkpoint it replaces becomes ``PATH.step-S`` (``S`` its
step), and only the newest ``keep`` checkpoints stay (``keep=2``: ``PATH`` and one
older). At every moment a complete checkpoint exists under one of these names.

The manifest (``pipetrain-manifest.json`` in the folder) holds the step and every
file's size and CRC-32, computed right after the save (each rank checksums a share of
the files); it is written last, so a checkpoint is complete only with it.
:func:`checkpoint_problem` checks a checkpoint against its manifest, then its index
(DCP's ``.metadata``, read without running code: :mod:`.checkpoint_reader`), then that
the step it holds is the manifest's. :func:`find_intact` returns the newest intact
checkpoint among the kept ones and says which newer ones are damaged and why, so a
resume falls back instead of failing; :func:`set_aside` renames a damaged one
(``PATH.damaged-step-S``), so that it never counts as kept. Nothing here runs a
collective: any rank may call it alone.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import shutil
import zlib
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipetrain.api.checkpoint_reader import UnsafeCheckpoint, read_index, read_meta

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
    "set_aside",
    "write_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST = "pipetrain-manifest.json"
"""The manifest's file name inside a checkpoint folder."""
_METADATA = ".metadata"
_CHUNK = 16 << 20


@dataclass(frozen=True)
class Candidate:
    """A checkpoint folder that may hold the run's newest intact state."""

    path: str
    step: int | None
    """Its step, as its manifest says (``None``: no readable manifest)."""


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a finished checkpoint: DCP's ``.metadata`` and pipetrain's
    manifest, which a save writes last.

    Example:
        >>> is_complete("/nonexistent/checkpoint")
        False
    """
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, _METADATA)) and os.path.isfile(os.path.join(path, MANIFEST))


def _crc32(path: str) -> int:
    value = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def _manifest(path: str) -> dict[str, Any] | None:
    """The manifest of ``path`` (``None``: there is none).

    Raises:
        ValueError: it is not a valid manifest (the message says what is wrong).
    """
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as file:
            value = json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"not JSON: {error}") from None
    if not isinstance(value, dict) or not isinstance(value.get("files"), dict):
        raise ValueError("it lists no files")
    if not isinstance(value.get("step"), int) or value["step"] < 0:
        raise ValueError(f"its step {value.get('step')!r} is not a step")
    for name, entry in value["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("crc32"), int)) or os.sep in name or name.startswith(".."):
            raise ValueError(f"its entry for {name!r} is not a file's size and checksum")
    return value


def _step(path: str) -> int | None:
    try:
        manifest = _manifest(path)
    except ValueError:
        return None
    return None if manifest is None else int(manifest["step"])


def checkpoint_problem(path: str | os.PathLike[str], *, checksums: bool = True) -> str | None:
    """What is wrong with the checkpoint at ``path`` (one phrase naming the file), or
    ``None`` if it is intact: its manifest valid, every file it lists present with its
    size (and, with ``checksums``, its CRC-32) as saved, its index readable without
    running code and naming no file beyond those, and the step it holds the manifest's.

    Example:
        >>> checkpoint_problem("/nonexistent/checkpoint")
        'no .metadata (an unfinished save)'
    """
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, _METADATA)):
        return f"no {_METADATA} (an unfinished save)"
    try:
        manifest = _manifest(path)
    except ValueError as error:
        return f"{MANIFEST} is not valid ({error})"
    if manifest is None:
        return f"no {MANIFEST} (the save stopped before its checksums were written)"
    files: dict[str, Any] = manifest["files"]
    if _METADATA not in files:
        return f"{MANIFEST} does not list {_METADATA}"
    for name, entry in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        have = os.path.getsize(file)
        if have != entry["bytes"]:
            cut = " (truncated)" if have < entry["bytes"] else ""
            return f"{name} is {have:,} bytes, saved as {entry['bytes']:,}{cut}"
    if checksums:
        for name, entry in sorted(files.items()):
            if _crc32(os.path.join(path, name)) != entry["crc32"]:
                return f"{name} does not match its checksum (changed or damaged since the save)"
    try:
        index = read_index(path)
        needed: dict[str, int] = {}
        for item in dict(index.storage_data or {}).values():
            name = str(item.relative_path)
            needed[name] = max(needed.get(name, 0), int(item.offset) + int(item.length))
    except UnsafeCheckpoint as error:
        return f"{_METADATA} holds what a checkpoint does not ({error}); it was not loaded"
    except Exception as error:
        return f"{_METADATA} is unreadable ({type(error).__name__}: {str(error)[:120]})"
    for name, size in sorted(needed.items()):
        if name not in files:
            return f"{name}, which the index needs, is not in {MANIFEST}"
        if files[name]["bytes"] < size:
            return f"{name} is {files[name]['bytes']:,} bytes but the index needs {size:,} (truncated)"
    try:
        step = read_meta(path)["step"]
    except (UnsafeCheckpoint, ValueError) as error:
        return f"its step cannot be read ({error})"
    if step != manifest["step"]:
        return f"{MANIFEST} says step {manifest['step']} but the checkpoint holds step {step}"
    return None


def kept_checkpoints(path: str | os.PathLike[str]) -> list[Candidate]:
    """Every checkpoint kept at ``path``, newest first: ``path`` and ``path.step-S`` (even
    unfinished: that is damage), a complete ``path.partial`` (written, not yet renamed)
    and a complete ``path.previous`` of earlier versions. At equal steps ``path`` comes
    first; folders set aside as damaged (``path.damaged-*``) are not kept checkpoints.

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

    def newest_first(c: Candidate) -> tuple[float, int]:
        if c.step is None:  # ``path`` is the newest a save committed; others, unknown
            return (-math.inf if c.path == path else 1.0, rank[c.path])
        return (-c.step, rank[c.path])

    return sorted(found, key=newest_first)


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


def _fsync_folder(folder: str) -> None:
    """Make the renames inside ``folder`` durable (where the platform allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def set_aside(path: str, candidate: Candidate) -> str:
    """Rename the damaged checkpoint ``candidate`` (kept at ``path``) to
    ``path.damaged-step-S`` (``path.damaged`` without a step; ``-2``, ``-3``... if taken),
    where no save or resume counts it; returns the new name.

    Example::

        set_aside("run/checkpoint", Candidate("run/checkpoint", 30))  # run/checkpoint.damaged-step-30
    """
    base = f"{path}.damaged" + (f"-step-{candidate.step}" if candidate.step is not None else "")
    target, n = base, 1
    while os.path.lexists(target):
        n += 1
        target = f"{base}-{n}"
    os.replace(candidate.path, target)
    _fsync_folder(os.path.dirname(os.path.abspath(path)))
    return target


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
    A kept checkpoint found damaged (its files against its manifest and index) is set
    aside and not counted.

    At every moment a complete checkpoint exists under one of the kept names.
    """
    if keep < 1:
        raise ValueError(f"keep={keep!r} must be at least 1 (the newest checkpoint)")
    legacy = path + ".previous"  # an earlier version's name for the checkpoint replaced
    if is_complete(legacy) and (step := _step(legacy)) is not None:
        if not os.path.lexists(f"{path}.step-{step}"):
            os.replace(legacy, f"{path}.step-{step}")
    if os.path.lexists(path):
        step = _step(path)
        if step is not None and checkpoint_problem(path, checksums=False) is None:
            aside = f"{path}.step-{step}"
            _remove(aside)
            os.replace(path, aside)
        else:
            aside = set_aside(path, Candidate(path, step))
            logger.warning("checkpoint %s is damaged; set aside as %s", path, aside)
    os.replace(partial, path)
    _fsync_folder(os.path.dirname(os.path.abspath(path)))
    older = [c for c in kept_checkpoints(path) if c.path not in (path, partial)]
    kept = 1
    for candidate in older:
        problem = checkpoint_problem(candidate.path, checksums=False) if kept < keep else None
        if kept < keep and problem is None:
            kept += 1
        elif problem is not None:
            aside = set_aside(path, candidate)
            logger.warning("checkpoint %s (step %s) is damaged: %s; set aside as %s",
                           candidate.path, candidate.step, problem, aside)
        else:
            _remove(candidate.path)
    if not is_complete(path + ".previous"):
        _remove(path + ".previous")  # an earlier version's cleanup that was cut short
    _fsync_folder(os.path.dirname(os.path.abspath(path)))
