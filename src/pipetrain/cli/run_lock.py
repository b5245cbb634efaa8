"""The lock of a run folder: one ``pipetrain train`` job writes into a run at a time.

Two jobs writing one run folder (a second ``--resume`` of a run that is still going,
two new runs started into the same ``--out``) would overwrite each other's checkpoint
and records. The job's launcher (or, under torchrun, its rank 0) holds an exclusive
POSIX lock (``fcntl.lockf``, which network file systems support) on ``RUN/.lock`` for
the whole job and writes who holds it into the file; a second job is refused, naming
the holder. The kernel releases the lock when the holder exits, however it exits
(``kill -9`` included), so a lock is never left stale: the file stays, unlocked.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from typing import Any

__all__ = ["LOCK_NAME", "RunFolderBusy", "RunLock"]

LOCK_NAME = ".lock"
"""The lock file's name inside a run folder."""


class RunFolderBusy(RuntimeError):
    """Another job holds the run folder's lock; the message names it and the fix."""


class RunLock:
    """An exclusive lock on run folder ``folder`` (created if missing), held until
    :meth:`release` or the end of this process.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> with RunLock(folder):
        ...     pass
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            RunFolderBusy: another process holds it (named, with what it runs).
            OSError: the folder cannot be created or written.
        """
        import fcntl

        os.makedirs(self.folder, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunFolderBusy(self._busy(holder)) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds"),
                  "command": " ".join(["pipetrain", *sys.argv[1:]])[:300]}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
        os.fsync(fd)
        self._fd = fd

    def busy(self) -> str | None:
        """Why the folder is in use (the message :meth:`acquire` would raise), or ``None``;
        creates nothing.

        Example:
            >>> RunLock("/nonexistent/run").busy() is None
            True
        """
        import fcntl

        if self._fd is not None or not os.path.isfile(self.path):
            return None
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:
            return None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return self._busy(_read_holder(fd))
        finally:
            os.close(fd)  # also lets go of the probe's lock; the file is left as it was
        return None

    def _busy(self, holder: dict[str, Any]) -> str:
        return (f"the run folder {self.folder!r} is in use by another pipetrain train job "
                f"({_describe(holder)}); two jobs would overwrite each other's checkpoint. "
                f"Fix: wait for it to end (or stop it: Ctrl-C saves), then --resume {self.folder}")

    def release(self) -> None:
        """Let go of the lock (the file stays)."""
        if self._fd is not None:
            os.close(self._fd)  # closing releases the process's POSIX lock
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        value = json.loads(os.read(fd, 4096).decode() or "{}")
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "its details are unreadable"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
            f"{holder.get('started', '?')}: {holder.get('command', '?')}")
