"""``pipetrain train``: the main job's command line.

Without arguments it trains a small byte-level GPT on the Python standard library's own
source files: 2 pipeline stages, 8 micro-batches, 1F1B, a few minutes on a 2-core CPU.
Outside a torch.distributed job the command checks its options, then launches its
workers itself (through torch.distributed.elastic); inside one (torchrun, or the workers
it launched) it trains. Whatever goes wrong, the last line says what and how to fix it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.train_options import add_train_arguments

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``train`` on the ``pipetrain`` command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "train",
        help="train a GPT as a pipeline (the main job)",
        allow_abbrev=False,
        description=(
            "Train a byte-level GPT with pipeline parallelism. Run as is, it spawns "
            "stages x replicas local workers; under torchrun it is one worker of a "
            "multi-machine job: on machine R of N, torchrun --nnodes N --node-rank R "
            "--nproc-per-node P --master-addr HOST --master-port PORT -m pipetrain train "
            "--stages K --replicas D (with N x P = K x D; see docs/multi-node.md). With --resume RUN it continues RUN in place, with RUN's "
            "options unless given again (changes are honoured and recorded in metrics.json)."
        ),
    )
    add_train_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def _fail(problems: list[str], status: int) -> int:
    for problem in problems:
        sys.stderr.write(f"pipetrain train: error: {problem}\n")
    return status


def run(args: argparse.Namespace) -> int:
    """Launch the workers (or, inside a job, be one); the exit status."""
    from pipetrain.cli.interrupts import deferred_interrupt

    with deferred_interrupt():  # torch's imports could swallow a Ctrl-C
        from pipetrain.launch import LaunchError, LaunchInterrupted, in_worker, launch_local
        from pipetrain.launch.local import COMMAND_LINE_ENV

    if in_worker():
        from pipetrain.cli.train_job import train_worker

        return train_worker(args)
    with deferred_interrupt():  # the checks import more of torch
        from pipetrain.cli.run_folder import new_run_problem, resume_source
        from pipetrain.cli.train_checks import prepare, schedule_notes

        config, _, problems = prepare(args)
        if config.out is None:
            config.out = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        out = config.out
        from pipetrain.cli.run_lock import RunFolderBusy, RunLock

        lock = RunLock(out)  # held by this launcher for the whole job
        resumed = resume_source(config.resume).run_folder if config.resume is not None else None
        busy = (RunLock(resumed) if resumed is not None else lock).busy()
        if busy is not None:  # what else is wrong may be a consequence (no checkpoint yet)
            return _fail([busy], 2)
        folder_problem = new_run_problem(out, resume=config.resume)
        if folder_problem is not None:
            problems.append(folder_problem)
        if problems:
            return _fail(problems, 2)
        try:
            lock.acquire()
        except (RunFolderBusy, OSError) as error:
            return _fail([f"--out {out!r}: {error}" if isinstance(error, OSError) else str(error)], 2)
        folder_problem = new_run_problem(out, resume=config.resume)  # a job that just ended
        if folder_problem is not None:
            lock.release()
            return _fail([folder_problem], 2)
        if not args.verbose:  # the workers' own lines say what happened; the agent's add noise
            for name in list(logging.root.manager.loggerDict):
                if name.startswith("torch.distributed.elastic"):
                    logging.getLogger(name).setLevel(logging.CRITICAL)
        from pipetrain.cli.precision_probe import precision_warning

        slower = precision_warning(config)
        if slower is not None:
            sys.stderr.write(f"pipetrain train: warning: {slower}\n")
        for note in schedule_notes(config):
            sys.stderr.write(f"pipetrain train: {note}\n")
        sys.stderr.write(f"pipetrain train: starting {config.num_workers} worker"
                         f"{'s' * (config.num_workers != 1)} ({config.describe()}) into {out}\n")
        sys.stderr.flush()
    from pipetrain.cli.restarts import RESTARTS_ENV, restart_record, restarted_argv
    from pipetrain.cli.stuck_report import ask_ranks, stuck_line

    argv = _argv_with_out(sys.argv[1:], out)
    restarts: list[dict[str, Any]] = []
    signal.signal(signal.SIGUSR1,  # where are the ranks? (a job that seems stuck)
                  lambda *_: ask_ranks(out, world_size=config.num_workers))
    while True:
        started = time.time()
        try:  # the workers record the command line as typed, not as the launcher passes it on
            launch_local(config.num_workers, argv,
                         environment={COMMAND_LINE_ENV: json.dumps(sys.argv[1:]),
                                      RESTARTS_ENV: json.dumps(restarts)})
        except LaunchError as error:
            line = _failure_line(error, config, started)
            stuck = stuck_line(out, since=started, world_size=config.num_workers)
            if stuck is not None:
                sys.stderr.write(f"pipetrain train: where the ranks were: {stuck}\n")
            if not config.max_restarts:
                return _fail([line], 2 if error.exitcode == 2 else 1)
            restart, why = restart_record(out, cause=line, exitcode=error.exitcode,
                                          done=len(restarts), limit=config.max_restarts,
                                          failed_at=time.time())
            if restart is None:
                return _fail([f"{line} (not restarted: {why})"], 2 if error.exitcode == 2 else 1)
            restarts.append(restart)
            sys.stderr.write(f"pipetrain train: restart {restart['number']} of "
                             f"{config.max_restarts}: {line}; restarting from the checkpoint "
                             f"at step {restart['resumed_from_step']}\n")
            sys.stderr.flush()
            argv = restarted_argv(argv, out)
            continue
        except LaunchInterrupted as error:
            return _interrupted(out, error.signal_number)
        return 0


def _failure_line(error: Any, args: RunConfig, started: float) -> str:
    """The worker's own message; for a worker that died without one (killed, crashed),
    or whose peers only saw it die, which rank and stage died, what the run keeps and
    how to continue (:mod:`pipetrain.cli.worker_death`)."""
    from pipetrain.cli.worker_death import death_line

    killed = error.killed
    if killed is not None and (not error.worker_message or killed[0] == error.rank
                               or f"rank {killed[0]} died" in error.worker_message):
        rank = killed[0]
        return death_line(args, rank=rank, exitcode=error.exitcodes[rank], started=started)
    if not error.worker_message:
        return death_line(args, rank=error.rank, exitcode=error.exitcode, started=started)
    return str(error.worker_message)


def _interrupted(out: str, signal_number: int) -> int:
    from pipetrain.cli.run_folder import read_json
    from pipetrain.cli.train_report import interrupted_line

    metrics = read_json(os.path.join(out, "metrics.json")) or {}
    stopped = metrics.get("stopped") or {}
    if stopped.get("reason") == "interrupted":
        line = interrupted_line(metrics, out)
    else:
        name = signal.Signals(signal_number).name
        line = (f"interrupted by {name} before the workers reached a step boundary: nothing "
                f"new was saved" + (f"; the records are in {out}" if metrics else ""))
    sys.stderr.write(f"pipetrain train: {line}\n")
    return 128 + signal_number


def _argv_with_out(argv: list[str], out: str) -> list[str]:
    argv = list(argv)
    if "--out" not in argv and not any(a.startswith("--out=") for a in argv):
        argv += ["--out", out]
    return argv
