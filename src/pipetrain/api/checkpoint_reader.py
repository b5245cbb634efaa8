"""Reading a checkpoint without running code from it.

torch.distributed.checkpoint stores its index (``.metadata``) as a pickle and loads the
non-tensor entries of a shard with ``torch.load(weights_only=False)``: a crafted run
folder would run its code in whoever reads it. :class:`SafeReader` reads the index
through an unpickler that admits only the classes an index holds (DCP's metadata
records, ``torch.Size``, dtypes, paths), and :class:`SafeLoadPlanner` loads the
non-tensor entries with ``weights_only=True``. pipetrain's own entry (``meta``: the
step, schedulers, loss scale, ``extra``) is JSON; :func:`decode_meta` also reads the
plain-data pickle of earlier versions, with no class admitted.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

__all__ = [
    "SafeLoadPlanner",
    "SafeReader",
    "UnsafeCheckpoint",
    "decode_meta",
    "encode_meta",
    "read_index",
    "read_meta",
]


class UnsafeCheckpoint(ValueError):
    """A checkpoint file holds an object pipetrain does not load (it could run code)."""


_MODULES = {
    "torch.distributed.checkpoint.metadata": None,  # any of its records
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "builtins": {"set", "frozenset"},
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle.Unpickler):
    """Admits DCP's index records and the plain values inside them, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        allowed = _MODULES.get(module, set())
        if allowed is None or name in allowed:
            value = super().find_class(module, name)
            if allowed is not None or isinstance(value, type):
                return value
        raise UnsafeCheckpoint(f"{module}.{name} is not a class a checkpoint's index holds")


class _NoClassUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpoint(f"{module}.{name} is not plain data")


class SafeReader(FileSystemReader):
    """A DCP :class:`FileSystemReader` whose index is read by a restricted unpickler.

    Example::

        dcp_load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with self.fs.create_stream(os.path.join(os.fspath(self.path), name), "rb") as file:
            metadata = _IndexUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"{name} holds a {type(metadata).__name__}, not an index")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        checked = io.BytesIO()  # what weights_only admitted, handed on in DCP's own format
        torch.save(torch.load(value, weights_only=True), checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


def read_index(path: str) -> Metadata:
    """The DCP index of the checkpoint at ``path``, read safely.

    Raises:
        UnsafeCheckpoint: ``.metadata`` holds objects an index does not.
        OSError, pickle.UnpicklingError, EOFError: it is missing or unreadable.
    """
    return SafeReader(path).read_metadata()


def encode_meta(meta: dict[str, Any]) -> bytes:
    """pipetrain's entry of a checkpoint, as JSON bytes.

    Raises:
        TypeError: a value is not JSON (``extra`` must be JSON: numbers, strings,
            lists, dicts).

    Example:
        >>> decode_meta(encode_meta({"step": 3, "extra": {"epoch": 1}}))["step"]
        3
    """
    try:
        return json.dumps(meta, sort_keys=True).encode()
    except (TypeError, ValueError) as error:
        raise TypeError(f"a checkpoint's extra state must be JSON (numbers, strings, lists, "
                        f"dicts): {error}; fix: convert it, e.g. a tensor with .tolist()") from None


def decode_meta(data: bytes) -> dict[str, Any]:
    """Read pipetrain's entry of a checkpoint (JSON; a plain-data pickle of earlier versions).

    Raises:
        UnsafeCheckpoint: the entry is neither.
    """
    try:
        if data[:1] == b"{":
            value = json.loads(data.decode())
        else:
            value = _NoClassUnpickler(io.BytesIO(data)).load()
    except (ValueError, pickle.UnpicklingError, EOFError) as error:
        raise UnsafeCheckpoint(f"pipetrain's entry is unreadable ({error})") from None
    if not isinstance(value, dict) or not isinstance(value.get("step"), int):
        raise UnsafeCheckpoint("pipetrain's entry holds no step")
    return value


def read_meta(path: str) -> dict[str, Any]:
    """pipetrain's entry of the checkpoint at ``path`` (step, schedulers, extra), read in
    this process alone (no collective, whatever process group exists).

    Raises:
        UnsafeCheckpoint: the index or the entry holds objects pipetrain does not load.
        ValueError: the checkpoint cannot be read (the message says why).
    """
    state: dict[str, Any] = {"meta": b""}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(),
                     no_dist=True)
    except CheckpointException as error:  # a BaseException: caught by name
        causes = [pair[0] for pair in error.failures.values()] if error.failures else []
        unsafe = next((c for c in causes if isinstance(c, UnsafeCheckpoint)), None)
        if unsafe is not None:
            raise UnsafeCheckpoint(str(unsafe)) from None
        raise ValueError(f"its entry cannot be read ({causes[0] if causes else error})") from None
    return decode_meta(state["meta"])
