"""Spawning a job's workers on this machine through torch.distributed.elastic.

``pipetrain train --stages 2`` starts ``python -m pipetrain train ...`` twice through
the elastic agent (the machinery behind ``torchrun``): the workers find each other at the
agent's store and see the usual ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables. Nothing of
a local job listens beyond loopback: the store is :mod:`.loopback`'s, and gloo (and NCCL's
bootstrap) use the loopback interface unless ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``)
says otherwise. The very same command line also runs under
``torchrun --nnodes N --nproc-per-node P -m pipetrain train ...`` on several machines.
When a worker dies the agent stops the others at once; the error names the rank.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing import api as elastic_processes
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from pipetrain.launch.loopback import BACKEND, LOOPBACK, register
from pipetrain.launch.processes import temporary_environment
from pipetrain.runtime.host_address import interface_of

__all__ = ["COMMAND_LINE_ENV", "LAUNCHED_ENV", "LaunchError", "LaunchInterrupted", "in_worker", "launch_local"]

logger = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
COMMAND_LINE_ENV = "PIPETRAIN_COMMAND_LINE"
"""The command line as the user typed it (JSON), for the workers' records."""
LAUNCHED_ENV = "PIPETRAIN_LAUNCHED"
"""Set to ``1`` in the workers :func:`launch_local` starts (they leave the last line of
an error to the launcher)."""


class LaunchError(RuntimeError):
    """A worker of a local job failed; the message names its rank and exit status, or is
    the worker's own message when it left one."""

    def __init__(self, message: str, *, rank: int, exitcode: int, worker_message: str,
                 exitcodes: dict[int, int] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.worker_message = worker_message
        """The failed worker's own one-line message ('' if it left none: it died)."""
        self.exitcodes = dict(exitcodes) if exitcodes is not None else {rank: exitcode}
        """Every failed worker's exit status by rank (negative: killed by that signal)."""

    @property
    def killed(self) -> tuple[int, str] | None:
        """``(rank, signal name)`` of the first worker killed by a signal other than the
        launcher's own stop (SIGTERM), else None.

        Example:
            >>> LaunchError("...", rank=0, exitcode=1, worker_message="x",
            ...             exitcodes={0: 1, 1: -9}).killed
            (1, 'SIGKILL')
        """
        ranks = [self.rank, *sorted(r for r in self.exitcodes if r != self.rank)]
        for rank in ranks:
            code = self.exitcodes[rank]
            if code < 0 and code != -signal.SIGTERM:
                return rank, _signal_name(-code)
        return None


class LaunchInterrupted(RuntimeError):
    """The launcher received SIGINT or SIGTERM; it passed the signal on to the workers
    and waited for them to stop."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signal_number).name}")
        self.signal_number = signal_number


def in_worker() -> bool:
    """Whether this process is a worker of a torch.distributed job (torchrun, elastic).

    Example:
        >>> isinstance(in_worker(), bool)
        True
    """
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_PORT" in os.environ
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {_signal_name(-exitcode)}"
    return f"exited with status {exitcode}"


def launch_local(nproc: int, argv: Sequence[str], *, monitor_interval: float = 0.2,
                 shutdown_timeout: int = 60, environment: Mapping[str, str] | None = None) -> None:
    """Run ``python -m pipetrain <argv>`` in ``nproc`` local worker processes (with
    ``environment`` added to what they inherit).

    A SIGINT or SIGTERM sent to this process is passed on to the workers, which get
    ``shutdown_timeout`` seconds to stop (e.g. to save a checkpoint) before they are killed;
    once they have stopped, this process ignores SIGINT and SIGTERM (a second Ctrl-C
    must not turn a clean stop into a traceback). Otherwise its own handlers are put back.

    Raises:
        LaunchError: a worker failed (the first failure is named: that rank's exit status
            or signal, and its error if it reported one).
        LaunchInterrupted: this process received SIGINT or SIGTERM.

    Example::

        launch_local(2, ["train", "--steps", "10"])
    """
    register()
    # the agent's per-run folder (the workers' error files) is removed once the job ends:
    # left to the agent it would stay behind in the system's temporary folder on every run
    with tempfile.TemporaryDirectory(prefix="pipetrain-launch-", ignore_cleanup_errors=True) as logs:
        _launch(nproc, argv, logs=logs, monitor_interval=monitor_interval,
                shutdown_timeout=shutdown_timeout, environment=environment)


def _launch(nproc: int, argv: Sequence[str], *, logs: str, monitor_interval: float,
            shutdown_timeout: int, environment: Mapping[str, str] | None) -> None:
    config = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=logs),
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"pipetrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend=BACKEND,
        rdzv_endpoint="",
        max_restarts=0,
        monitor_interval=monitor_interval,
        shutdown_timeout=shutdown_timeout,
    )
    handlers = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    interrupted = False
    try:
        with temporary_environment(_worker_environment(nproc, dict(environment or {}))), \
                _one_stop_signal():
            elastic_launch(config, sys.executable)("-u", "-m", "pipetrain", *argv)
    except SignalException as error:
        interrupted = True  # the workers had their stop; another signal must not undo it
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        _wait_for_workers(shutdown_timeout)  # a second signal may have cut the agent's wait short
        raise LaunchInterrupted(int(error.sigval)) from None
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        detail = ""
        if failure.message and isinstance(failure.message, dict):
            detail = str(failure.message.get("message", "")).strip()
        elif failure.message:
            detail = str(failure.message).strip()
        if detail.startswith("To enable traceback see") or detail == "<N/A>" or (
                failure.exitcode < 0 and detail.startswith("Signal ")):
            detail = ""  # the agent's words, not the worker's: "Signal 9 (SIGKILL) received by PID"
        raise LaunchError(
            f"worker rank {rank} {_describe(failure.exitcode)}"
            + (f": {detail}" if detail else "")
            + f" ({len(error.failures)} of {nproc} workers failed; the others were stopped)",
            rank=rank, exitcode=failure.exitcode, worker_message=detail,
            exitcodes={r: f.exitcode for r, f in error.failures.items()},
        ) from None
    finally:
        if not interrupted:  # the agent's handlers raise; give the caller's back
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


@contextmanager
def _one_stop_signal() -> Iterator[None]:
    """The agent's signal handler raises on the first SIGINT / SIGTERM only: it raises on
    every one, so a second Ctrl-C while the agent waits for the workers to save cut that wait
    short, or surfaced as a traceback from wherever Python happened to be (a weakref
    callback prints "Exception ignored"). Later signals are ignored until the workers end."""
    original = getattr(elastic_processes, "_terminate_process_handler", None)
    if original is None:  # a torch without it: its own handler stands
        yield
        return
    seen: list[int] = []

    def first_only(number: int, frame: FrameType | None) -> None:
        if not seen:
            seen.append(number)
            original(number, frame)

    setattr(elastic_processes, "_terminate_process_handler", first_only)  # noqa: B010
    try:
        yield
    finally:
        setattr(elastic_processes, "_terminate_process_handler", original)  # noqa: B010


def _children() -> list[int]:
    """This process's child processes (Linux; else none)."""
    found: list[int] = []
    for task in glob.glob("/proc/self/task/*/children"):
        try:
            with open(task) as file:
                found += [int(pid) for pid in file.read().split()]
        except (OSError, ValueError):
            continue
    return found


def _wait_for_workers(timeout: float) -> None:
    """Wait up to ``timeout`` seconds for this process's children (the workers, saving
    after the signal) to end; kill those still running then."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid == 0 and time.monotonic() >= deadline:
            break
        if pid == 0:
            time.sleep(0.1)
    for pid in _children():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _worker_environment(nproc: int, extra: dict[str, str]) -> dict[str, str]:
    """What the workers inherit, set while they are started and taken back after: each
    worker's math single-threaded unless the user chose otherwise (K workers share the
    cores instead of fighting), and gloo / NCCL on the loopback interface."""
    values = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)), LAUNCHED_ENV: "1"}
    loopback = interface_of(LOOPBACK)
    if loopback is not None:
        values |= {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback}
    return {name: value for name, value in values.items()
            if name == LAUNCHED_ENV or name not in os.environ} | extra
