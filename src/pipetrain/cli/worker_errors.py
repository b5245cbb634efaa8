"""How a ``pipetrain train`` worker ends on an error: one line a user can act on.

A worker's error is classified once. A mistake in the options or inputs
(:class:`UsageError`, exit status 2), a run stopped on purpose (:class:`RunStopped`),
a dead peer, a timeout, and the library's own ``ValueError`` / ``TypeError`` (which name
the bad value and the fix) are user-facing: the worker records the message, and its
traceback appears only with ``pipetrain -v``. Any other exception is internal and keeps
its traceback. The message goes to the error file that torch.distributed.elastic reads
(``TORCHELASTIC_ERROR_FILE``), so the launcher's last line is the worker's own message;
under torchrun the worker prints it itself (rank 0 for a mistake every rank makes).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence

from pipetrain.cli.record_writes import free_space_line
from pipetrain.launch.local import LAUNCHED_ENV

__all__ = [
    "EXIT_FAILED",
    "EXIT_USAGE",
    "RunStopped",
    "UsageError",
    "end_within",
    "report_failure",
]

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
"""Exit status of a mistake in the options or inputs."""
EXIT_FAILED = 1
"""Exit status of a run that failed or was stopped by an error."""


class UsageError(ValueError):
    """Mistakes in the options or inputs, found by every rank alike (exit status 2)."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


class RunStopped(RuntimeError):
    """The run stopped on purpose (e.g. a non-finite step); its records are written."""


def _user_facing(error: BaseException) -> bool:
    from pipetrain.api.checkpointing import CheckpointError
    from pipetrain.runtime.errors import PipelineError

    return isinstance(error, (UsageError, RunStopped, PipelineError, ValueError, TypeError,
                              FileNotFoundError, ArithmeticError, CheckpointError)) or (
        _disk_trouble(error) is not None)


_DISK = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is used up",
         errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied"}


def _disk_trouble(error: BaseException) -> str | None:
    """One line for a write that failed for want of space or permission, else None."""
    if not isinstance(error, OSError) or error.errno not in _DISK:
        return None
    where = error.filename or "the run folder"
    free = ""
    if error.filename and error.errno in (errno.ENOSPC, errno.EDQUOT):
        # the file's own file system (without a file name, no guess: the working
        # directory's may be another disk)
        free = f" ({free_space_line(str(error.filename))})"
    return (f"writing {where!r} failed: {_DISK[error.errno]}{free}; the checkpoint and records "
            "written before are kept. Fix: free space or fix the permissions, or train into "
            "another --out")


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    if isinstance(error, (UsageError, RunStopped)):
        return " ".join(text.split("\n"))
    disk = _disk_trouble(error)
    if disk is not None:
        return disk
    return f"{type(error).__name__}: {' '.join(text.splitlines())}"


def _record(message: str, details: str) -> None:
    """Write the elastic error file (its documented JSON form) if the launcher asked for one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": details, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(data, file)
    except OSError:
        logger.debug("could not write the error file %s", path)


def report_failure(error: BaseException, *, rank: int, verbose: bool) -> int:
    """Report ``error`` (raised in worker ``rank``) and return the worker's exit status."""
    launched = os.environ.get(LAUNCHED_ENV) == "1"
    user_facing = _user_facing(error)
    message = _first_line(error)
    details = "".join(traceback.format_exception(error))
    if not user_facing or verbose:
        sys.stderr.write(f"[rank {rank}] {details}")
    _record(message, details)
    everyone = isinstance(error, UsageError)  # every rank finds the same mistake
    if not launched and (rank == 0 or not everyone):
        sys.stderr.write(f"pipetrain train: error: {message}\n")
    sys.stderr.flush()
    return EXIT_USAGE if isinstance(error, UsageError) else EXIT_FAILED


def end_within(seconds: float, error: BaseException, *, rank: int, verbose: bool) -> bool:
    """If ``error`` means the job's peers failed or cannot be reached, make sure this worker
    ends within ``seconds`` with its message (a clean-up that waits on a dead peer or an
    unreachable store would otherwise hang it); whether it does.

    Example:
        >>> end_within(5.0, ValueError("a bad option"), rank=0, verbose=False)
        False
    """
    from pipetrain.runtime.errors import PipelineError
    from pipetrain.runtime.monitor import is_communication_error

    if not (isinstance(error, PipelineError) or is_communication_error(error)):
        return False

    def end() -> None:
        status = report_failure(error, rank=rank, verbose=verbose)
        sys.stdout.flush()
        os._exit(status)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()
    return True
