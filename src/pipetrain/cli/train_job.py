"""The main job, inside one worker: train the GPT as a pipeline and keep the run folder.

Every rank runs this loop; rank 0 shows the progress and writes the run folder
(``config.json``, ``metrics.json``, ``timeline.png``, ``trace.json``, ``sample.txt``;
every rank writes its shard of ``checkpoint/``). Whatever ends the run — its last step,
a non-finite step, Ctrl-C / SIGTERM, a failed sample — the records are written first.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import decimal
import json
import logging
import os
import signal as signals
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.api.grad_check import NonFiniteError
from pipetrain.api.mesh import mesh_record
from pipetrain.api.pipeline import Pipeline
from pipetrain.cli.auto_balance import agree_on_balance
from pipetrain.cli.model_record import layout_record, model_record
from pipetrain.cli.restarts import torchrun_restart
from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.run_folder import write_json
from pipetrain.cli.run_model import (
    RunDataset,
    RunTokenizer,
    data_line,
    data_record,
    pipeline_model,
    run_dataset,
    sample_text,
)
from pipetrain.cli.stop_signals import StopRequest
from pipetrain.cli.stuck_report import watch_requests
from pipetrain.cli.train_checks import Resume, prepare
from pipetrain.cli.train_layout import AUTO, run_config
from pipetrain.cli.train_optimizer import honour_options, optimizer_record, training_factories
from pipetrain.cli.train_options import flag, gpt_config
from pipetrain.cli.train_records import RunRecords
from pipetrain.cli.train_report import (
    gather_step,
    interrupted_line,
    one_axis,
    peak_memory_bytes,
    report,
)
from pipetrain.cli.train_start import agree_on_folder, agree_on_options, phase
from pipetrain.cli.worker_errors import RunStopped, UsageError, end_within, report_failure
from pipetrain.counts import count_of
from pipetrain.data import real_tokens
from pipetrain.launch.local import COMMAND_LINE_ENV, LAUNCHED_ENV
from pipetrain.models.gpt_tp import gpt_plan
from pipetrain.runtime.errors import PeerFailure
from pipetrain.runtime.host_memory import host_memory_setting
from pipetrain.runtime.process_group import init_distributed
from pipetrain.runtime.rank_report import rank_report
from pipetrain.trace import ProgressBar, measure_step

__all__ = ["plain_number", "train_worker"]

logger = logging.getLogger(__name__)

_CLEANUP_SECONDS = 10.0
"""Seconds a worker whose peers failed gets to clean up before it ends anyway."""


def plain_number(value: float) -> str:
    """``value`` as a plain decimal, the way a user types it (no exponent).

    Example:
        >>> plain_number(1e8), plain_number(1e-2 / 10), plain_number(3e-6), plain_number(2.5)
        ('100000000', '0.001', '0.000003', '2.5')
    """
    text = format(decimal.Decimal(repr(float(value))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def train_worker(args: argparse.Namespace) -> int:
    """Train on this rank (called in every worker); its exit status."""
    stop = StopRequest()
    stop.install()
    rank = int(os.environ.get("RANK", "0"))
    verbose = bool(getattr(args, "verbose", False))
    try:
        typed = os.environ.get(COMMAND_LINE_ENV)  # as the user typed it, from the launcher
        command_line = None if typed is None else json.loads(typed)
        config, resume, problems = prepare(args, command_line=command_line)
        if not problems:
            try:  # torchrun started this worker again: resume the run folder
                restarted = torchrun_restart(args, config.out)
            except ValueError as error:
                raise UsageError([str(error)]) from None
            if restarted is not None:
                config, resume, problems = prepare(restarted, command_line=command_line)
        if problems:
            raise UsageError(problems)
        return _join_and_train(config, resume, stop, verbose=verbose)
    except BaseException as error:  # SystemExit and KeyboardInterrupt included: one line
        if isinstance(error, SystemExit) and not error.code:
            raise
        return report_failure(error, rank=rank, verbose=verbose)
    finally:
        stop.uninstall()


def _join_and_train(args: RunConfig, resume: Resume | None, stop: StopRequest, *,
                    verbose: bool) -> int:
    context = init_distributed(timeout=args.timeout)
    peers_lost = False
    try:
        agree_on_options(args)
        lock = agree_on_folder(args, resume)  # noqa: F841 (held until the job ends)
        phase(f"{count_of(dist.get_world_size(), 'worker')} joined; building the model and its "
              "pipeline")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        host_memory = host_memory_setting(args.host_memory, context.device)
        signals.signal(signals.SIGUSR1, signals.SIG_IGN)  # the launcher's (see .stuck_report)
        model_config = gpt_config(args)
        dataset, tokenizer = run_dataset(args)
        data = data_record(args, dataset, tokenizer)
        phase(data_line(data))
        if args.eval_every and data["val_tokens"] == 0:
            raise UsageError(f"--eval-every {args.eval_every}: the data has no validation split "
                             f"({data['description']}); fix: --eval-every 0, or return a "
                             "val_data from the model file")
        if args.balance == AUTO and args.model == "gpt":
            args = agree_on_balance(args, model_config, dataset, device=context.device)
        model, model_arguments = pipeline_model(args, model_config, dataset,
                                                vocab_size=tokenizer.vocab_size)
        model_block = model_record(args, model_config, model)
        optimizer, lr_scheduler, from_file = training_factories(args, model_arguments)
        pipe = Pipeline(
            model,
            **model_arguments,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            config=run_config(args),
            context=context,
            tensor_parallel_plan=gpt_plan(args.sequence_parallel) if args.tensor_parallel > 1 else None,
        )
        phase(f"pipeline ready ({args.describe()})")
        try:
            return _Run(pipe, args, dataset, tokenizer, model_block, resume, stop, verbose=verbose,
                        from_file=from_file, host_memory=host_memory).run()
        finally:
            pipe.close()
    except BaseException as error:
        # the peers are gone or unreachable: no clean-up may wait on them, and the worker
        # ends (with its message) within seconds even if one does
        peers_lost = end_within(_CLEANUP_SECONDS, error, rank=dist.get_rank(), verbose=verbose)
        raise
    finally:
        if dist.is_initialized() and not peers_lost:
            dist.destroy_process_group()


class _Run:
    """One session of a run: load, train, stop or finish, write."""

    def __init__(self, pipe: Pipeline, args: RunConfig, dataset: RunDataset,
                 tokenizer: RunTokenizer, model_block: dict[str, Any], resume: Resume | None,
                 stop: StopRequest, *, verbose: bool, from_file: dict[str, bool],
                 host_memory: str) -> None:
        self.pipe, self.args, self.dataset, self.model_block = pipe, args, dataset, model_block
        self.host_memory = host_memory
        """What the worker's malloc does with freed memory (config.json)."""
        self.from_file = from_file
        """Whether the optimizer / the LR scheduler came from the model file."""
        self.tokenizer = tokenizer
        self.resume, self.stop, self.verbose = resume, stop, verbose
        self.rank = dist.get_rank()
        self.device = pipe.device if dist.get_backend() == "nccl" else torch.device("cpu")
        self.start = 0
        self.saved_step: int | None = None if resume is None else resume.step
        """The step of the run's newest checkpoint (every rank knows it)."""
        self.records: RunRecords | None = None
        self.bar: ProgressBar | None = None
        self._watch: threading.Event | None = None
        pipe.at_forced_exit(self._forced_exit)

    # -- set-up ---------------------------------------------------------------------------
    def _load(self) -> None:
        if self.resume is None:
            return
        self.pipe.load(self.resume.checkpoint)  # rank 0 verifies it, sets damaged ones aside
        self.start = self.saved_step = self.pipe.step
        if not (self.from_file["optimizer"] or self.from_file["lr_scheduler"]):
            honour_options(self.pipe, self.args)  # a model file's restore their own

    def _describe_resume(self) -> str:
        assert self.resume is not None
        text = (f"resuming {self.resume.run_folder or self.resume.checkpoint} at step {self.start}: "
                f"training steps {self.start + 1}-{self.args.steps} "
                f"({count_of(self.args.steps - self.start, 'step')}) into {self.args.folder}")
        if self.resume.changes:
            text += "; changed: " + ", ".join(
                f"{flag(name, old)} -> {new}" for name, (old, new) in self.resume.changes.items())
        return text

    def _open_records(self) -> None:
        # where this rank is, written whenever the launcher asks (SIGUSR1 to the launcher)
        self._watch = watch_requests(self.args.folder, self._write_rank_report)
        if self.rank != 0:
            return
        args = self.args
        os.makedirs(args.folder, exist_ok=True)
        record = args.record()
        options = record["options"]
        write_json(os.path.join(args.folder, "config.json"),
                   {"args": options, "sources": record["sources"],
                    "command_line": record["command_line"], "model": self.model_block,
                    "layout": layout_record(self.pipe), "mesh": mesh_record(self.pipe.config),
                    "optimizer": optimizer_record(self.pipe, self.from_file),
                    "data": data_record(args, self.dataset, self.tokenizer),
                    "world_size": dist.get_world_size(), "host_memory": self.host_memory})
        self.records = RunRecords(
            args.folder, options, world_size=dist.get_world_size(), first_step=self.start + 1,
            history=None if self.resume is None else self.resume.run_folder,
            changes=None if self.resume is None else self.resume.changes,
            checkpoint_step=self.saved_step, log=args.log)
        self.records.schedule = lambda: self.pipe.schedule()  # the step as it runs
        self.records.mesh = mesh_record(self.pipe.config)
        self.records.sources = record["sources"]
        self.records.command_line = record["command_line"]
        self.records.write()
        for tracker in self.records.trackers:
            if tracker.missing is not None:
                sys.stderr.write(f"pipetrain train: note: {tracker.missing}\n")
        if self.resume is not None and self.pipe.loaded is not None:
            for warning in self.pipe.loaded.passed_over:
                sys.stderr.write(f"pipetrain train: warning: {warning}\n")
            sys.stderr.write(self._describe_resume() + "\n")
        self.bar = ProgressBar(args.steps, initial_step=self.start)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        """Train this session; the exit status (the TensorBoard events closed however it ends)."""
        try:
            return self._run()
        finally:
            if self._watch is not None:
                self._watch.set()
            if self.records is not None:
                self.records.close()

    def _run(self) -> int:
        self._load()
        self._open_records()
        try:
            try:
                for step in range(self.start, self.args.steps):
                    self._train_one(step)
                    with self.pipe.guard():
                        signal = self.stop.agreed(self.device)
                    if signal is not None:
                        return self._interrupted(signal)
                self._close_bar()
                self._save()
            except NonFiniteError as error:
                self._nonfinite(error)  # raises RunStopped once its records are written
        except RunStopped:
            raise
        except BaseException as error:  # a failed save included: the records say so
            self._write_failure(error)
            raise
        return self._finish()

    def _train_one(self, step: int) -> None:
        pipe, args = self.pipe, self.args
        inputs, targets = self.dataset.batch(step, args.step_batch_size)
        began = time.perf_counter()
        loss = pipe.train_step(inputs, targets)
        seconds = time.perf_counter() - began
        with pipe.guard():
            gathered = gather_step(pipe)
        record: dict[str, Any] = {}
        if self.rank == 0:
            assert gathered is not None and self.bar is not None and self.records is not None
            timeline = one_axis(gathered)
            measure = measure_step(timeline, num_ranks=len(gathered))
            record = {"step": step + 1, "loss": loss, "seconds": seconds,
                      "tokens_per_s": real_tokens(targets) / seconds,
                      "bubble": measure.bubble_fraction,
                      "lr": pipe.optimizers.learning_rate}
            if pipe.grad_norm is not None:
                record["grad_norm"] = pipe.grad_norm
            if pipe.last_step_skipped:
                record["skipped"] = True
            if args.compile and step == self.start:  # this session's workers compiled
                record["compiled"] = True
                phase(f"step {step + 1} compiled the stages' layers (torch.compile) in "
                      f"{seconds:,.1f} s")
            self.records.add(record, measure, timeline)
            self.bar.update(step + 1, loss=loss, tokens_per_s=record["tokens_per_s"],
                            bubble=measure.bubble_fraction)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            val_inputs, val_targets = self.dataset.batch(step, args.batch_size, split="val")
            val = pipe.eval_step(val_inputs, val_targets)
            record["val_loss"] = val
        if self.records is not None:
            self.records.logged(record)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            self._save()

    # -- saving and ending ---------------------------------------------------------------------
    def _save(self) -> None:
        if self.records is not None:  # the history first: it never falls behind a checkpoint
            self.records.sync()
        self.pipe.save(os.path.join(self.args.folder, "checkpoint"),
                       extra={"data_step": self.pipe.step}, keep=self.args.keep_checkpoints)
        self.saved_step = self.pipe.step
        if self.records is not None:
            self.records.checkpoint_step = self.pipe.step

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _pictures(self) -> None:
        if self.records is not None:
            self.records.write(pictures=True, title=self.args.describe())

    def _interrupted(self, signal: Any) -> int:
        self._close_bar()
        saved = self.pipe.step > self.start and self.pipe.step != self.saved_step
        if self.rank == 0:
            sys.stderr.write(f"pipetrain train: {signal.name}: stopping after step {self.pipe.step}"
                             + (", saving it" if saved else "") + "\n")
            sys.stderr.flush()
        if saved:  # a signal during a periodic save: that save holds this step already
            self._save()
        if self.records is not None:
            self.records.stopped = {"reason": "interrupted", "signal": signal.name,
                                    "at_step": self.pipe.step, "checkpoint_step": self.saved_step,
                                    "saved_now": saved}
            self._pictures()
            if os.environ.get(LAUNCHED_ENV) != "1":
                sys.stderr.write(f"pipetrain train: {interrupted_line(self.records.metrics(), self.args.folder)}\n")
        return 128 + int(signal)

    def _nonfinite(self, error: NonFiniteError) -> None:
        self._close_bar()
        if self.pipe.step > self.start:
            self._save()  # the weights of the last good step: the bad update was not applied
        checkpoint = self.saved_step
        if self.records is not None:
            self.records.stopped = {"reason": "nonfinite", "at_step": error.step, "loss": error.loss,
                                    "grad_norm": error.grad_norm, "checkpoint_step": checkpoint}
            self._pictures()
        kept = (f"the checkpoint in {self.args.folder}/checkpoint holds the last good step ({checkpoint})"
                if checkpoint is not None else "no checkpoint was saved (no step before it was good)")
        clip = "" if self.args.clip > 0 else " or --clip 1 (clipping is off)"
        raise RunStopped(
            f"step {error.step} is not finite (loss {error.loss:.6g}, gradient norm "
            f"{error.grad_norm:.6g}); no stage applied its update and {kept}. Fix: a lower "
            f"--lr (now {plain_number(self.args.lr)}, e.g. --lr {plain_number(self.args.lr / 10)})"
            f"{clip}, then "
            f"--resume {self.args.folder}; or --nonfinite skip to skip such steps"
        ) from None

    def _forced_exit(self, failure: PeerFailure) -> None:
        """End a worker that a peer's failure left blocked (from the monitor's thread):
        its records, where it was and its one-line message first, then the exit status of a
        failure."""
        self._write_rank_report()
        if self.records is not None:
            self.records.stop({"reason": "error", "at_step": self.pipe.step,
                               "message": str(failure).splitlines()[0][:500],
                               "checkpoint_step": self.saved_step, "forced_exit": True})
        status = report_failure(failure, rank=self.rank, verbose=self.verbose)
        sys.stdout.flush()
        os._exit(status)

    def _write_rank_report(self) -> None:
        """``hang/rank<R>.json``: where this rank is (see :mod:`pipetrain.runtime.rank_report`)."""
        try:
            os.makedirs(os.path.join(self.args.folder, "hang"), exist_ok=True)
            write_json(os.path.join(self.args.folder, "hang", f"rank{self.rank}.json"),
                       rank_report(self.pipe.executor, step=self.pipe.step))
        except Exception:  # a description only: the failure itself is what the run reports
            logger.debug("could not write rank %d's report", self.rank, exc_info=True)

    def _write_failure(self, error: BaseException) -> None:
        """Keep the records of a run that fails, and where this rank was (its action, the
        message it waited for: ``hang/rank<R>.json``); no collective here: peers may be gone."""
        self._close_bar()
        self._write_rank_report()
        if self.records is None:
            return
        self.records.stopped = {"reason": "error", "at_step": self.pipe.step,
                                "message": f"{type(error).__name__}: {error}".splitlines()[0][:500],
                                "checkpoint_step": self.saved_step}
        try:
            self.records.write()
        except Exception:
            logger.exception("could not write the records of the failed run")

    def _finish(self) -> int:
        memory: list[Any] = [None] * dist.get_world_size()
        with self.pipe.guard():
            dist.all_gather_object(memory, {"rank": self.rank,
                                            "stages": list(self.pipe.local_stages),
                                            "peak_memory_bytes": peak_memory_bytes(self.pipe.device),
                                            "store_calls_per_s": self.pipe.store_calls_per_second})
        if self.records is not None:
            self.records.monitor = [{"rank": entry["rank"],
                                     "store_calls_per_s": entry.pop("store_calls_per_s")}
                                    for entry in memory]
            self.records.memory = memory
            self.records.stopped = {"reason": "finished", "at_step": self.pipe.step,
                                    "checkpoint_step": self.saved_step}
        # the pictures are drawn beside the sampling, where this rank mostly waits for the
        # last stage's logits
        with concurrent.futures.ThreadPoolExecutor(1, "pipetrain-pictures") as drawing:
            drawn = drawing.submit(self._pictures)
            try:
                sample = (_sample(self.pipe, self.args, self.tokenizer,
                                  positions=getattr(self.dataset, "boundaries", False))
                          if self.args.sample_bytes else None)
            except Exception as error:
                concurrent.futures.wait([drawn])
                self._write_failure(error)
                raise RunStopped(
                    f"training finished (checkpoint and records in {self.args.folder}), but "
                    f"sampling failed: {type(error).__name__}: {error}"
                ) from error
            drawn.result()
        if self.records is not None:
            self.records.sample = sample
            self.records.write()  # sample.txt too
            report(self.args.folder, self.records, sample)
        return 0


def _sample(pipe: Pipeline, args: RunConfig, tokenizer: RunTokenizer, *, positions: bool) -> str:
    return sample_text(pipe, tokenizer, prompt="def ", num_tokens=args.sample_bytes,
                       temperature=0.8, top_k=40, seed=args.seed, context=args.context,
                       positions=positions)
