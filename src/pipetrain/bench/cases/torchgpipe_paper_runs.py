"""The torchgpipe paper's runners, each in its own process: pipetrain.GPipe, torchgpipe.GPipe
and the plain model train the same setting; their outputs are checked, their peak memory
measured and their steps timed in turn.

Each runner lives in a process of its own (spawned), as its users run it: pipetrain's
partition threads and torchgpipe's device thread do not share a process, and the peak
memory of one is not the other's (the CPU figure is the whole process's resident set).
A process serves settings one after another: for each, it builds the model, answers
the eval-mode output of the batch (the three must agree: the same function of the same
weights), and takes steps. Memory is measured in a second process per runner, started
with :data:`~pipetrain.bench.harness.EXACT_MALLOC` and taking no timed step: its peak
(RSS growth from after the model was built, see
:class:`~pipetrain.bench.harness.PeakMemory`) over the first training step and over the
first :data:`PEAK_STEPS`. With glibc's default heap a setting reuses what the previous one
of the process freed and seems to need less (torchgpipe's ``always`` measured above its
``except_last`` that way); the timed processes keep the default allocator, as users run
them. :meth:`Runners.time` interleaves the runners: after a warm-up, rounds in which each
runner in turn (the first one rotating) takes one untimed step then ``block`` timed ones,
so a busy spell of a shared machine hits all of them alike.

A training step is torchgpipe's benchmarks' (``benchmarks/amoebanetd-speed``): forward,
the loss, backward, an SGD update, gradients zeroed.

Example::

    with Runners(timeout=120.0) as runners:
        check = runners.setup(setting)            # outputs agree; first-step MiB, threads
        times, load = runners.time(warmup=2, rounds=4, block=3)
        peaks = runners.peaks()                   # MiB over its first PEAK_STEPS steps
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from pipetrain.bench.cases.torchgpipe_paper_models import RUNNERS, Workload, wrap
from pipetrain.bench.gpipe_runs import ONE_THREAD, library
from pipetrain.bench.harness import (
    EXACT_MALLOC,
    CpuWindow,
    PeakMemory,
    foreign_load,
    memory_available,
)
from pipetrain.launch.processes import temporary_environment

__all__ = ["ONE_THREAD", "PEAK_STEPS", "Runners", "Setting", "library", "serve"]

_MEMORY = "-memory"
"""Suffix of a runner's memory process in :class:`Runners`."""

_LEARNING_RATE = 1e-3
PEAK_STEPS = 3
"""Training steps of a setting over which a memory process takes its peak (the first
included)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    """One measured configuration: the workload, its balance, chunks and checkpoint mode.

    Example:
        >>> work = Workload(model="unet", size=(2, 4), image=16, batch=4)
        >>> Setting(workload=work, balance=(5, 6), chunks=2, checkpoint="never").num_partitions
        2
    """

    workload: Workload
    balance: tuple[int, ...]
    chunks: int
    checkpoint: str

    @property
    def num_partitions(self) -> int:
        return len(self.balance)


class _Trainer:
    """One runner's model of one setting, its batch and its optimizer."""

    def __init__(self, runner: str, setting: Setting) -> None:
        self.workload = setting.workload
        self.model = wrap(library(runner), setting.workload.build(), balance=list(setting.balance),
                          chunks=setting.chunks, checkpoint=setting.checkpoint)
        self.inputs, self.target = setting.workload.inputs()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=_LEARNING_RATE)

    def eval_output(self) -> torch.Tensor:
        self.model.eval()
        with torch.no_grad():
            output: torch.Tensor = self.model(self.inputs)
        self.model.train()
        return output

    def step(self) -> None:
        loss = self.workload.loss(self.model(self.inputs), self.target)
        torch.autograd.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _process_main(runner: str, conn: Connection, threads: int | None) -> None:
    """A runner's process: its intra-op threads (``None``: torch's default), then
    :func:`serve`."""
    if threads is not None:
        torch.set_num_threads(threads)
    gc.freeze()  # the modules imported so far: the collections before each setting skip them
    serve(runner, conn)


def serve(runner: str, conn: Connection) -> None:
    """A runner: answers the parent's requests until it sends ``None``.

    Requests: ``("setup", setting)`` -> ``(eval output, first-step MiB, torch's thread
    count)``; ``("steps", untimed, timed)`` -> the timed steps' seconds; ``("peak",)`` ->
    MiB over every step of the setting. A failure is answered ``("error", traceback)``.

    Example (a thread standing in for the process)::

        parent, child = multiprocessing.Pipe()
        threading.Thread(target=serve, args=("plain", child)).start()
        parent.send(("setup", setting)); status, (output, mib, threads) = parent.recv()
        parent.send(None)
    """
    meter = PeakMemory([torch.device("cpu")]) if memory_available([torch.device("cpu")]) \
        else None
    trainer: _Trainer | None = None
    while True:
        request = conn.recv()
        if request is None:
            return
        try:
            if request[0] == "setup":
                trainer = None  # what it held is collected when the meter starts
                trainer = _Trainer(runner, request[1])
                output = trainer.eval_output()
                if meter is not None:
                    meter.start()
                trainer.step()
                mib = meter.peak_mib() if meter is not None else None
                conn.send(("ok", (output, mib, torch.get_num_threads())))
            elif request[0] == "steps":
                assert trainer is not None, "steps before setup"
                _, untimed, timed = request
                for _ in range(untimed):
                    trainer.step()
                seconds = []
                for _ in range(timed):
                    started = time.perf_counter()
                    trainer.step()
                    seconds.append(time.perf_counter() - started)
                conn.send(("ok", seconds))
            else:
                conn.send(("ok", meter.peak_mib() if meter is not None else None))
        except Exception:  # the parent raises it, naming the runner
            conn.send(("error", traceback.format_exc()))


class Runners:
    """The three runners' processes, started together; each serves settings in turn.

    ``timeout`` bounds every wait for a runner's answer (seconds): a runner that does
    not answer in time is named in the error (and ended on leaving). ``threads``: each
    process's intra-op threads (``None``: torch's default, as its users run it).
    """

    def __init__(self, *, timeout: float, threads: int | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.timeout = timeout
        self.names: tuple[str, ...] = (*RUNNERS, *extra)
        self._conns: dict[str, Connection] = {}
        self._processes: dict[str, Any] = {}
        self._start(threads, "")
        with temporary_environment(EXACT_MALLOC):  # read by each process's allocator
            self._start(threads, _MEMORY)

    def _start(self, threads: int | None, suffix: str) -> None:
        context = mp.get_context("spawn")
        for runner in self.names:
            parent_end, child_end = context.Pipe()
            own = 1 if runner.endswith(ONE_THREAD) else threads
            process = context.Process(target=_process_main, args=(runner, child_end, own),
                                      daemon=True, name=f"torchgpipe_paper-{runner}{suffix}")
            process.start()
            child_end.close()
            self._conns[runner + suffix], self._processes[runner + suffix] = parent_end, process

    def __enter__(self) -> Runners:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _ask(self, runner: str, request: Any) -> Any:
        self._conns[runner].send(request)
        return self._answer(runner, request[0])

    def _answer(self, runner: str, what: str) -> Any:
        conn = self._conns[runner]
        if not conn.poll(self.timeout):
            raise RuntimeError(f"the {runner} runner did not answer {what!r} within "
                               f"{self.timeout:.0f} s")
        try:
            status, value = conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the {runner} runner's process ended during {what!r}") from None
        if status == "error":
            raise RuntimeError(f"the {runner} runner failed during {what!r}:\n{value}")
        return value

    def setup(self, setting: Setting) -> dict[str, Any]:
        """Build ``setting`` in every runner: ``(first-step peak MiB, torch threads)`` by
        runner, after checking that their eval-mode outputs equal the plain model's.

        Raises:
            RuntimeError: a runner failed or its output differs from the plain model's.
        """
        for name in self._conns:  # the runners build at once (nothing is timed yet)
            self._conns[name].send(("setup", setting))
        answers = {runner: self._answer(runner, "setup") for runner in self.names}
        memory = {runner: self._answer(runner + _MEMORY, "setup") for runner in self.names}
        reference = answers["plain"][0]
        scale = max(1.0, reference.abs().max().item())
        for runner, (output, *_) in answers.items():
            difference = (output - reference).abs().max().item()
            if difference > 1e-4 * scale:
                raise RuntimeError(f"{runner}'s output differs from the plain model's by "
                                   f"{difference:.3g} in {setting}")
        return {runner: (memory[runner][1], threads)
                for runner, (_, _, threads) in answers.items()}

    def time(self, *, warmup: int, rounds: int, block: int
             ) -> tuple[dict[str, list[float]], dict[str, float | None]]:
        """Seconds of ``rounds * block`` timed steps of each runner, interleaved; and the
        cores other processes of the machine used meanwhile
        (:func:`~pipetrain.bench.harness.foreign_load`: ``other_cores``)."""
        for runner in self.names:
            self._ask(runner, ("steps", warmup, 0))
        seconds: dict[str, list[float]] = {runner: [] for runner in self.names}
        window, cpu_before = CpuWindow(), self._cpu_seconds()
        for r in range(rounds):
            for k in range(len(self.names)):
                runner = self.names[(r + k) % len(self.names)]
                seconds[runner] += self._ask(runner, ("steps", 1, block))
        figures = window.close()
        figures["own_cpu_s"] = (figures["own_cpu_s"] or 0.0) + self._cpu_seconds() - cpu_before
        return seconds, foreign_load([figures])

    def _cpu_seconds(self) -> float:
        """CPU seconds the runners' processes have used so far (0 where unknown)."""
        total = 0.0
        for process in self._processes.values():
            try:
                with open(f"/proc/{process.pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError):
                pass
        return total

    def peaks(self) -> dict[str, float | None]:
        """Every runner's peak MiB over the first :data:`PEAK_STEPS` steps of the current
        setting (in its memory process)."""
        for runner in self.names:
            self._ask(runner + _MEMORY, ("steps", PEAK_STEPS - 1, 0))
        return {runner: self._ask(runner + _MEMORY, ("peak",)) for runner in self.names}

    def close(self) -> None:
        """Stop the processes (each is asked to end, then ended if it does not)."""
        for conn in self._conns.values():
            try:
                conn.send(None)
            except OSError:  # its process has ended already
                pass
        for runner, process in self._processes.items():
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
            self._conns[runner].close()
