"""Spawning a job's workers on this machine through torch.distributed.elastic.

``pipetrain train --stages 2`` starts ``python -m pipetrain train ...`` twice through
the elastic agent (the machinery behind ``torchrun``): the workers find each other at a
c10d rendezvous on 127.0.0.1 and see the usual ``RANK``/``WORLD_SIZE``/``MASTER_*``
variables, so the very same command line also runs under
``torchrun --nnodes N --nproc-per-node P -m pipetrain train ...`` on several machines.
When a worker dies the agent stops the others at once; the error names the rank.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

__all__ = ["LaunchError", "in_worker", "launch_local"]

logger = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A worker of a local job failed; the message names its rank and exit status."""


def in_worker() -> bool:
    """Whether this process is a worker of a torch.distributed job (torchrun, elastic).

    Example:
        >>> isinstance(in_worker(), bool)
        True
    """
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_PORT" in os.environ
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def launch_local(nproc: int, argv: Sequence[str], *, monitor_interval: float = 0.2) -> None:
    """Run ``python -m pipetrain <argv>`` in ``nproc`` local worker processes.

    Raises:
        LaunchError: a worker failed (the first failure is named: that rank's exit status
            or signal, and its error if it reported one).

    Example::

        launch_local(2, ["train", "--steps", "10"])
    """
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"pipetrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=monitor_interval,
    )
    # workers inherit this environment; keep each worker's math single-threaded unless
    # the user chose otherwise, so K workers share the cores instead of fighting
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "pipetrain", *argv)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        detail = ""
        if failure.message and isinstance(failure.message, dict):
            detail = str(failure.message.get("message", "")).strip()
        elif failure.message:
            detail = str(failure.message).strip()
        raise LaunchError(
            f"worker rank {rank} {_describe(failure.exitcode)}"
            + (f": {detail}" if detail and detail != "<N/A>" else "")
            + f" ({len(error.failures)} of {nproc} workers failed; the others were stopped)"
        ) from None
