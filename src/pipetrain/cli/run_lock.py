"""The lock of a run folder: one ``pipetrain train`` job writes into a run at a time.

Two jobs writing one run folder (a second ``--resume`` of a run that is still going,
two new runs started into the same ``--out``) would overwrite each other's checkpoint
and records. The job's launcher (or, under torchrun, its rank 0) holds an exclusive
POSIX lock (``fcntl.lockf``, which network file systems support) on ``RUN/.lock`` for
the whole job and writes who holds it into the file; a second job is refused, naming
the holder. The kernel releases the lock when the holder exits, however it exits
(``kill -9`` included), so a lock is never left stale: the file stays, unlocked.

The file is its owner's alone (mode 0600: another user cannot open it to hold a lock of
their own on it), and a refusal names the process that really holds the lock (read from
``/proc/locks`` on Linux), not only what the file says.
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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_mode & 0o077:
                os.fchmod(fd, 0o600)  # a lock file of an earlier version, readable by all
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
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
            return self._busy(_holder(fd))
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


def _lock_holders(fd: int) -> list[int]:
    """The pids holding a POSIX lock on ``fd``'s file, from ``/proc/locks`` (Linux; else [])."""
    status = os.fstat(fd)
    device = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as file:
            rows = [line.split() for line in file if "->" not in line]
    except OSError:
        return []
    return sorted({int(row[4]) for row in rows if len(row) > 5 and row[5] == device
                   and row[1] == "POSIX" and row[4].isdigit()})


def _process(pid: int) -> str:
    """``pid``'s user and command line, as far as this user may read them."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return f"pid {pid}"
    try:
        import pwd

        user = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        user = str(uid)
    return f"pid {pid} of user {user}: {command[:200] or '?'}"


def _holder(fd: int) -> dict[str, Any]:
    """Who holds the lock on ``fd``'s file: what the file says, and the real holder
    where that is another process (``real``)."""
    holder = _read_holder(fd)
    pids = _lock_holders(fd)
    if pids and (holder.get("pid") not in pids or holder.get("host") != socket.gethostname()):
        holder = {"real": "; ".join(_process(pid) for pid in pids)}
    return holder


def _describe(holder: dict[str, Any]) -> str:
    if "real" in holder:
        return f"the lock is held by {holder['real']}"
    if not holder:
        return "its details are unreadable"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
            f"{holder.get('started', '?')}: {holder.get('command', '?')}")
