"""What the ranks of a ``pipetrain train`` job settle before they train: the same options
on every host, one run folder (locked against a second job), and start-up feedback."""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch.distributed as dist

from pipetrain.api.agreement import DisagreementError, refuse_disagreement
from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.run_folder import new_run_problem
from pipetrain.cli.run_lock import RunFolderBusy, RunLock
from pipetrain.cli.train_options import flag, recorded
from pipetrain.cli.train_resolve import Resume
from pipetrain.cli.worker_errors import UsageError
from pipetrain.launch.local import LAUNCHED_ENV

__all__ = ["agree_on_folder", "agree_on_options", "phase"]


def phase(text: str) -> None:
    """One line of start-up feedback, on rank 0."""
    if dist.get_rank() == 0:
        sys.stderr.write(f"pipetrain train: {text}\n")
        sys.stderr.flush()


_PER_HOST = ("timeout", "out", "config")
"""Options each host may give differently (``--out``: rank 0's is taken by all; a config
file's path: its values are compared)."""


def agree_on_options(args: RunConfig) -> None:
    """Refuse, on every rank, hosts launched with different options (a layer would run
    on no rank, or two cuts of the model would train side by side)."""
    options = {flag(name, "").strip(): value for name, value in recorded(args, _PER_HOST).items()}
    try:
        refuse_disagreement(options, what="the options of `pipetrain train`",
                            fix="launch every host with the same options")
    except DisagreementError as error:
        raise UsageError([str(error)]) from None


def agree_on_folder(args: RunConfig, resume: Resume | None) -> RunLock | None:
    """Rank 0 picks and checks the run folder before anyone writes, and locks it unless
    this job's launcher holds the lock; everyone takes its answer. The lock (rank 0's)."""
    verdict: list[Any] = [None, None]
    lock: RunLock | None = None
    if dist.get_rank() == 0:
        out = args.out or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        problem = new_run_problem(out, resume=args.resume)
        if args.max_restarts and os.environ.get(LAUNCHED_ENV) != "1":
            problem = (f"--max-restarts {args.max_restarts}: under torchrun, torchrun restarts "
                       "the workers; fix: leave out --max-restarts and give torchrun "
                       f"--max-restarts {args.max_restarts}, with --out DIR: a restarted "
                       "worker resumes DIR's newest checkpoint")
        if problem is None and os.environ.get(LAUNCHED_ENV) != "1":  # under torchrun
            lock = RunLock(out)
            try:
                lock.acquire()
            except RunFolderBusy as error:
                lock, problem = None, str(error)
            except OSError as error:
                lock, problem = None, f"--out {out!r}: {error}"
        verdict = [out, problem]
    dist.broadcast_object_list(verdict, src=0)
    args.out, problem = verdict
    if problem is not None:
        raise UsageError([problem])
    return lock
