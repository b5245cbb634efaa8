"""pipetrain vs torch.distributed.pipelining: the same training step, side by side, in one run.

What it measures
----------------
Part 1 (MLP, communication- and overhead-sensitive): 2 ranks (processes), 1 intra-op
thread each, gloo on 127.0.0.1. The model is ``depth`` x [Linear(width, width) + GELU]
(default 8 x 1024; each pair one layer, built from pipetrain's seeded layer factories, so
both frameworks start from the same weights), batch 64 split into 8 micro-batches, MSE
loss against a fixed target, SGD. One *training step* is timed as a whole: forward,
backward and the optimizer step (pipetrain: ``Pipeline.train_step``, which also returns
the mean loss on every rank; torch: ``schedule.step(...)`` + ``optimizer.step()`` +
``zero_grad()``, nothing else). For every schedule both frameworks have:

=================  ============================  =========================================
name               pipetrain                     torch.distributed.pipelining
=================  ============================  =========================================
gpipe              ``gpipe``                     ``ScheduleGPipe``
1f1b               ``1f1b``                      ``Schedule1F1B``
interleaved-1f1b   ``interleaved-1f1b``, V = 2    ``ScheduleInterleaved1F1B``, 2 stages/rank
zero-bubble        ``zb-h1`` (1 stage per rank)  ``ScheduleInterleavedZeroBubble`` with 2
                                                 stages per rank (loop placement) and
                                                 ``ScheduleZBVZeroBubble`` (V placement)
looped-bfs         ``looped-bfs``, V = 2          ``ScheduleLoopedBFS``, 2 stages/rank
zb-v               ``zb-v`` (V placement)         ``ScheduleZBVZeroBubble``
dualpipe-v         ``dualpipe-v`` (V placement)   ``ScheduleDualPipeV``
=================  ============================  =========================================

torch has no ZB-H1 as such; its zero-bubble schedules are written for several stages per
rank. ``ScheduleInterleavedZeroBubble`` given ONE stage per rank runs exactly ZB-H1's action
order on 2 ranks (the script checks the order torch actually ran against pipetrain's), so it
is the like-for-like comparison; its 2-stages-per-rank form and ``ScheduleZBVZeroBubble``
(which needs exactly 2 stages per rank, V placement) cut the model into 4 stages instead of
2 (same compute, twice the stage boundaries) and are reported too. The ratio of a schedule
is taken against the fastest torch variant. A torch variant that cannot be built or run
is reported as "torch: not comparable (reason)".

Method: all runners (every framework x schedule) live in the same two processes; after a
warm-up, repetitions go round-robin over them; each timed step starts after a barrier and
is timed with ``perf_counter`` on each rank, the step time being the max over the ranks.
Figures are medians over repetitions. The losses of the first two steps of every runner
are compared with each other and with the whole model trained in one process (same
weights, same batches: the same work).

Where the time goes. pipetrain records every action it runs; the script gathers both
ranks' actions of every timed step, puts them on one time axis (``offsets_from_origins``)
and compares the makespan with the simulator's prediction from the costs measured in the
same step (``simulate(pipe.schedule(M), measure_step(...).mean_costs)``); it also gives
the prediction with the time the sends took on the sender added to the compute before
them (the simulator counts a send as free). For torch the forward / backward calls of its
stages and its optimizer step are timed (two ``perf_counter`` reads per call; switch off
with ``--no-trace-torch``), which gives torch's busy time, its own makespan and the same
simulator comparison on the order torch ran; torch's gradient scaling (every gradient
divided by M after the last backward) is shown apart. As a framework-neutral yardstick
both are compared with an *ideal* step: their action order simulated with per-stage
forward / backward / SGD costs measured in isolation (plain autograd on the stage modules,
both ranks at once, no communication; a split backward counts as half + half of the full
one). ``bound`` = torch's step / pipetrain's ideal step: the ratio a zero-overhead
pipetrain would reach. Per rank and step the script also reports the CPU time of the main
thread and of all other threads of the process (pipetrain's receive threads, gloo's device
threads, monitors): on 2 cores busy with 2 ranks, background CPU is taken from compute.

``--malloc-tuned`` runs the workers with glibc's ``MALLOC_TRIM_THRESHOLD_`` and
``MALLOC_MMAP_THRESHOLD_`` raised, so that freed memory is kept: with the defaults the 4 MB
weight-gradient temporaries of a backward page-fault on every micro-batch, which doubles
the cost of the zero-bubble schedules' weight passes (``W``) in both frameworks.

Part 2 (GPT, compute-bound): the default model of ``pipetrain train`` (GPTConfig(
num_layers=4, width=64, num_heads=4, context=128), batch 32, AdamW lr 3e-3 with betas
(0.9, 0.95) and weight decay 0.1, gradient clipping at 1.0, 1F1B, 2 stages, 8
micro-batches; no LR schedule) trained by pipetrain on 2 ranks x 1 thread vs the same
model trained in ONE process with 1 thread (plain PyTorch, same batches, same optimizer,
same clipping), alternating step by step; the speedup of the medians (ideal: 2x).

Run it
------
::

    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py            # both parts
    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py --json     # one JSON object
    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py --mlp --reps 5 --warmup 2
    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py --gpt
    PYTHONPATH=src python benchmarks/vs_torch_pipelining.py --malloc-tuned

(``python`` being the project's virtual environment; ~70 s for both parts on 2 cores.)

Goals
-----
* pipetrain >= 1.2x torch's throughput (steps/s) on every schedule both have;
* pipetrain's measured step within 10% of the simulator's prediction from its measured
  action costs.

The machine should be quiet: with 2 processes on 2 cores anything else running shows up
directly in the figures (and hurts the 2-process pipeline more than the 1-process
baseline of part 2). The script reports the CPU that other processes used during each
timed loop (from ``/proc/stat``, minus our own processes' CPU time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from pipetrain.launch import run_processes

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "looped-bfs", "zb-v", "dualpipe-v")
"""pipetrain's schedules compared, by the name used in the report."""

# torch runners per schedule: (label, torch class name, stages per rank, placement)
TORCH_VARIANTS: dict[str, tuple[tuple[str, str, int, str], ...]] = {
    "gpipe": (("ScheduleGPipe", "ScheduleGPipe", 1, "loop"),),
    "1f1b": (("Schedule1F1B", "Schedule1F1B", 1, "loop"),),
    "interleaved-1f1b": (("ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B", 2, "loop"),),
    "zb-h1": (
        ("ScheduleInterleavedZeroBubble(V=1)", "ScheduleInterleavedZeroBubble", 1, "loop"),
        ("ScheduleInterleavedZeroBubble(V=2)", "ScheduleInterleavedZeroBubble", 2, "loop"),
        ("ScheduleZBVZeroBubble", "ScheduleZBVZeroBubble", 2, "v"),
    ),
    # 2 stages per rank: looped placement (BFS) and the V (ZB-V, DualPipe-V), as pipetrain's
    "looped-bfs": (("ScheduleLoopedBFS", "ScheduleLoopedBFS", 2, "loop"),),
    "zb-v": (("ScheduleZBVZeroBubble(zb-v)", "ScheduleZBVZeroBubble", 2, "v"),),
    "dualpipe-v": (("ScheduleDualPipeV", "ScheduleDualPipeV", 2, "v"),),
}
WORLD_SIZE = 2
LR = 0.01
GOAL_RATIO = 1.2
GOAL_GAP = 0.10


# ---------------------------------------------------------------------------------------
# spawning a 2-rank gloo job (as tests/helpers/distributed.py does)
# ---------------------------------------------------------------------------------------


def run_job(fn: Callable[..., Any], opts: Any, *, timeout: float) -> list[Any]:
    """Run ``fn(context, opts)`` on the benchmark's ranks (one intra-op thread each)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned interpreters
    if opts.malloc_tuned:
        # glibc malloc: keep freed memory instead of returning it to the system, so that
        # the 4 MB gradient temporaries of a backward do not page-fault every time
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(1 << 30)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 26)
    return run_processes(fn, WORLD_SIZE, opts, timeout=timeout)


# ---------------------------------------------------------------------------------------
# how busy the machine was: CPU time of everything else while we measured
# ---------------------------------------------------------------------------------------


def _busy_seconds() -> float | None:
    """CPU seconds all processes of the machine have used since boot (``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuWindow:
    """Wall time, machine-wide busy CPU time and this process's CPU time over a window;
    every rank opens and closes it at the same barriers."""

    def __init__(self) -> None:
        self.start = (time.perf_counter(), _busy_seconds(), time.process_time())
        self.result: dict[str, float | None] = {}

    def close(self) -> dict[str, float | None]:
        wall0, busy0, own0 = self.start
        busy1 = _busy_seconds()
        self.result = {"wall_s": time.perf_counter() - wall0,
                       "machine_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0,
                       "own_cpu_s": time.process_time() - own0}
        return self.result


def foreign_load(windows: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    """Cores used by other processes on average during the window (rank 0's machine
    figures minus every rank's own CPU time)."""
    wall = windows[0]["wall_s"]
    busy = windows[0]["machine_busy_s"]
    own = sum(w["own_cpu_s"] or 0.0 for w in windows)
    if busy is None or not wall:
        return {"wall_s": wall, "our_cores": own / wall if wall else None, "other_cores": None}
    return {"wall_s": wall, "our_cores": own / wall, "other_cores": max(0.0, busy - own) / wall}


# ---------------------------------------------------------------------------------------
# runners: one training step of one (framework, schedule)
# ---------------------------------------------------------------------------------------


def _stage_ranges(num_layers: int, num_stages: int) -> list[range]:
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for j in range(num_stages):
        stop = start + base + (1 if j < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return ranges


def _placement(kind: str, num_stages: int) -> tuple[int, ...]:
    from pipetrain.schedule import loop_placement, v_placement

    if kind == "v":
        return v_placement(WORLD_SIZE)
    return loop_placement(WORLD_SIZE, num_stages // WORLD_SIZE)


class PipetrainRunner:
    """pipetrain's ``Pipeline`` for one schedule."""

    framework = "pipetrain"

    def __init__(self, ctx: Any, schedule: str, factories: Sequence[Any], opts: Any) -> None:
        import torch

        from pipetrain.api.config import PipelineConfig
        from pipetrain.api.pipeline import Pipeline
        from pipetrain.schedule import V_SCHEDULES, default_stages_per_rank

        self.schedule_name = schedule
        self.label = schedule
        stages_per_rank = default_stages_per_rank(schedule)
        self.pipe = Pipeline(
            list(factories),
            loss_fn=torch.nn.functional.mse_loss,
            optimizer=lambda params: torch.optim.SGD(params, lr=LR),
            config=PipelineConfig(schedule=schedule, num_stages=WORLD_SIZE,
                                  stages_per_rank=stages_per_rank,
                                  num_microbatches=opts.microbatches),
            context=ctx,
        )
        self.num_stages = WORLD_SIZE * stages_per_rank
        self.stage_to_rank = _placement("v" if schedule in V_SCHEDULES else "loop", self.num_stages)
        self.records: list[tuple[float, list[Any]]] = []

    def step(self, x: Any, y: Any) -> float:
        return self.pipe.train_step(x, y)

    def after_timed_step(self) -> None:
        self.records.append((self.pipe.last_step_start, list(self.pipe.last_timeline)))

    def close(self) -> None:
        self.pipe.close()


class TorchRunner:
    """torch.distributed.pipelining: PipelineStage(s) + a schedule + one SGD per rank."""

    framework = "torch"

    def __init__(self, ctx: Any, schedule: str, variant: tuple[str, str, int, str],
                 factories: Sequence[Any], opts: Any) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed import pipelining

        self.schedule_name = schedule
        self.label, class_name, stages_per_rank, placement = variant
        self.num_stages = WORLD_SIZE * stages_per_rank
        self.stage_to_rank = _placement(placement, self.num_stages)
        rank = dist.get_rank()
        # its own process group: a failing torch schedule cannot disturb the others
        self.group = dist.new_group(list(range(WORLD_SIZE)),
                                    timeout=_timedelta(opts.torch_timeout))
        self.local = [j for j in range(self.num_stages) if self.stage_to_rank[j] == rank]
        ranges = _stage_ranges(len(factories), self.num_stages)
        self.modules = {j: nn.Sequential(*(factories[i]() for i in ranges[j])) for j in self.local}
        self.stages = [
            pipelining.PipelineStage(self.modules[j], j, self.num_stages, torch.device("cpu"),
                                     group=self.group)
            for j in self.local
        ]
        cls = getattr(pipelining, class_name)
        loss_fn = torch.nn.functional.mse_loss
        if stages_per_rank == 1 and class_name in ("ScheduleGPipe", "Schedule1F1B"):
            self.schedule = cls(self.stages[0], opts.microbatches, loss_fn=loss_fn)
        else:
            self.schedule = cls(self.stages, opts.microbatches, loss_fn=loss_fn)
        params = [p for m in self.modules.values() for p in m.parameters()]
        self.optimizer = torch.optim.SGD(params, lr=LR)
        self.has_first = 0 in self.local
        self.has_last = self.num_stages - 1 in self.local
        self.microbatches = opts.microbatches
        self.rank = rank
        self._losses: list[Any] = []
        # (stage, op, micro-batch, start, end) of the last step, seconds since its start
        self.events: list[tuple[int, str, int | None, float, float]] = []
        self.records: list[tuple[float, list[Any]]] = []
        self.scale_seconds: list[float] = []
        self._origin = 0.0
        self._wall_origin = 0.0
        if opts.trace_torch:
            for stage in self.stages:
                self._instrument(stage)

    def _instrument(self, stage: Any) -> None:
        """Time the stage's compute calls (two perf_counter reads and an append each)."""
        j = stage.stage_index
        clock = time.perf_counter
        events = self.events
        forward, backward, weight = (stage.forward_one_chunk, stage.backward_one_chunk,
                                     stage.backward_weight_one_chunk)
        scale, reduce = stage.scale_grads, stage.perform_reduce_grad

        def timed_forward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return forward(chunk, *args, **kwargs)
            finally:
                events.append((j, "F", chunk, start, clock()))

        def timed_backward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return backward(chunk, *args, **kwargs)
            finally:
                events.append((j, "B" if kwargs.get("full_backward", True) else "I", chunk,
                               start, clock()))

        def timed_weight(chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return weight(chunk, *args, **kwargs)
            finally:
                events.append((j, "W", chunk, start, clock()))

        def timed_scale(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return scale(*args, **kwargs)
            finally:
                events.append((j, "SCALE", None, start, clock()))

        def timed_reduce(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return reduce(*args, **kwargs)
            finally:
                events.append((j, "SCALE", None, start, clock()))

        stage.forward_one_chunk = timed_forward
        stage.backward_one_chunk = timed_backward
        stage.backward_weight_one_chunk = timed_weight
        stage.scale_grads = timed_scale
        stage.perform_reduce_grad = timed_reduce

    def step(self, x: Any, y: Any) -> None:
        self.events.clear()
        self._wall_origin = time.time()
        self._origin = time.perf_counter()
        self._losses = []
        args = (x,) if self.has_first else ()
        if self.has_last:
            self.schedule.step(*args, target=y, losses=self._losses)
        else:
            self.schedule.step(*args)
        start = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.events.append((self.local[0], "STEP", None, start, time.perf_counter()))

    def after_timed_step(self) -> None:
        """Keep the step's compute actions as pipetrain TimedActions (outside the timing).

        torch's gradient scaling (``scale_grads``: every gradient divided by M after the
        last backward) has no pipetrain action: it is kept under the name SCALE, apart.
        The optimizer step of the rank is shared evenly among its stages' STEP actions."""
        from pipetrain.schedule import Action, Op, TimedAction

        ops = {"F": Op.FORWARD, "B": Op.BACKWARD, "I": Op.BACKWARD_INPUT,
               "W": Op.BACKWARD_WEIGHT}
        timeline, scaled = [], 0.0
        for j, op, i, start, end in self.events:
            start, end = start - self._origin, end - self._origin
            if op == "SCALE":
                scaled += end - start
            elif op == "STEP":
                share = (end - start) / len(self.local)
                for k, stage in enumerate(self.local):
                    timeline.append(TimedAction(self.rank, Action(stage, Op.OPTIMIZER_STEP),
                                                start + k * share, start + (k + 1) * share))
            else:
                timeline.append(TimedAction(self.rank, Action(j, ops[op], i), start, end))
        self.records.append((self._wall_origin, timeline))
        self.scale_seconds.append(scaled)

    def loss(self) -> float:
        """The mean loss of the last step on every rank (a collective, outside the timing)."""
        import torch
        import torch.distributed as dist

        local = torch.zeros((), dtype=torch.float64)
        if self.has_last:
            local += sum(float(v.detach()) for v in self._losses) / self.microbatches
        dist.all_reduce(local, group=self.group)
        return float(local)

    def compute_order(self) -> list[list[tuple[str, int, int]]]:
        """torch's compute actions per rank, as (op, stage, micro-batch)."""
        order = self.schedule.pipeline_order
        return [[(a.computation_type.value, a.stage_index, a.microbatch_index)
                 for a in order[r]
                 if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
                for r in range(WORLD_SIZE)]

    def close(self) -> None:
        pass


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


# ---------------------------------------------------------------------------------------
# isolated per-stage costs (the yardstick)
# ---------------------------------------------------------------------------------------


def _isolated_costs(factories: Sequence[Any], num_stages: int, stage_to_rank: Sequence[int],
                    batch: int, microbatches: int, width: int, repeats: int) -> dict[str, Any]:
    """Median forward / backward / SGD-step seconds of this rank's stages (no pipeline)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    rank = dist.get_rank()
    ranges = _stage_ranges(len(factories), num_stages)
    mb = batch // microbatches
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(mb, width, generator=gen)
    t = torch.randn(mb, width, generator=gen)
    out: dict[str, Any] = {"forward": {}, "backward": {}, "step": {}}
    for j in range(num_stages):
        if stage_to_rank[j] != rank:
            continue
        module = nn.Sequential(*(factories[i]() for i in ranges[j]))
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        grad = torch.ones(mb, width)
        fwd, bwd, stp = [], [], []
        # as in a step: M forwards and backwards accumulate, then one SGD step
        for k in range(max(1, repeats // microbatches) + 1):
            for _ in range(microbatches):
                inp = x.clone().requires_grad_(j > 0)
                t0 = time.perf_counter()
                y = module(inp)
                loss = torch.nn.functional.mse_loss(y, t) if j == num_stages - 1 else None
                t1 = time.perf_counter()
                if loss is not None:
                    loss.backward()
                else:
                    y.backward(grad)
                t2 = time.perf_counter()
                if k > 0:  # the first round warms up
                    fwd.append(t1 - t0)
                    bwd.append(t2 - t1)
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if k > 0:
                stp.append(time.perf_counter() - t2)
        out["forward"][j] = statistics.median(fwd)
        out["backward"][j] = statistics.median(bwd)
        out["step"][j] = statistics.median(stp) if stp else 0.0
    return out


def _merge_costs(per_rank: Sequence[dict[str, Any]], num_stages: int) -> dict[str, list[float]]:
    merged: dict[str, list[float]] = {}
    for name in ("forward", "backward", "step"):
        values = {}
        for costs in per_rank:
            values.update(costs[name])
        merged[name] = [values[j] for j in range(num_stages)]
    return merged


def _ideal(schedule: Any, costs: dict[str, list[float]]) -> dict[str, float]:
    """Simulated step (no communication) and busiest rank's compute under isolated costs."""
    from pipetrain.schedule import Costs, simulate

    c = Costs(forward=tuple(costs["forward"]), backward=tuple(costs["backward"]),
              step=tuple(costs["step"]))
    result = simulate(schedule, c)
    return {"ideal_s": result.makespan, "floor_s": max(result.busy),
            "ideal_bubble": result.bubble_fraction}


def _torch_schedule_as_pipetrain(order: list[list[tuple[str, int, int]]], *, name: str,
                                 num_microbatches: int, stage_to_rank: Sequence[int]) -> Any:
    """torch's compute order as a pipetrain Schedule (sends / receives / STEP added)."""
    from pipetrain.schedule import (
        Action,
        Op,
        Schedule,
        add_communication,
        add_optimizer_step,
        validate,
    )

    ops = {"F": Op.FORWARD, "B": Op.BACKWARD, "I": Op.BACKWARD_INPUT, "W": Op.BACKWARD_WEIGHT}
    actions = tuple(tuple(Action(j, ops[op], i) for op, j, i in rank_order) for rank_order in order)
    schedule = Schedule(name=name, num_microbatches=num_microbatches,
                        stage_to_rank=tuple(stage_to_rank), actions=actions)
    schedule = add_optimizer_step(add_communication(schedule), reduce=True)
    validate(schedule)
    return schedule


# ---------------------------------------------------------------------------------------
# part 1: the MLP, every schedule, both frameworks
# ---------------------------------------------------------------------------------------


def _agree(local_ok: bool, message: str) -> list[str]:
    """Every rank's error message ('' = ok): a collective, so no rank runs on alone."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, "" if local_ok else message)
    return [m for m in gathered if m]


def mlp_worker(ctx: Any, opts: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from pipetrain.models import mlp_layer_factories

    rank = dist.get_rank()
    factories = mlp_layer_factories(width=opts.width, depth=opts.depth, activation="gelu", seed=0)
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randn(opts.batch, opts.width, generator=gen) for _ in range(4)]
    target = torch.randn(opts.batch, opts.width, generator=gen)  # fixed target

    runners: list[Any] = []
    failures: dict[str, str] = {}
    for schedule in opts.schedules:
        runners.append(PipetrainRunner(ctx, schedule, factories, opts))
        for variant in TORCH_VARIANTS[schedule]:
            error = ""
            runner = None
            try:
                runner = TorchRunner(ctx, schedule, variant, factories, opts)
            except Exception as exc:  # an API limit: report, do not crash
                error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            errors = _agree(not error, error)
            if errors:
                failures[variant[0]] = errors[0]
            else:
                runners.append(runner)

    # first steps: the same losses? (also the first warm-up steps)
    first_losses: dict[str, list[float]] = {}
    for runner in list(runners):
        losses: list[float] = []
        error = ""
        try:
            for k in range(2):
                value = runner.step(pool[k % len(pool)], target)
                losses.append(value if runner.framework == "pipetrain" else runner.loss())
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        errors = _agree(not error, error)
        if errors:
            failures[runner.label] = "first step failed: " + errors[0]
            runners.remove(runner)
            continue
        first_losses[runner.label if runner.framework == "torch" else f"pipetrain:{runner.label}"] = losses

    # reference: the whole model in this process, same batch, same SGD
    reference = _reference_losses(factories, pool, target)

    # isolated per-stage costs for 2 and 4 stages (both ranks at once)
    isolated: dict[int, list[dict[str, Any]]] = {}
    for num_stages in sorted({r.num_stages for r in runners}):
        dist.barrier()
        mine = _isolated_costs(factories, num_stages, _placement("loop", num_stages), opts.batch,
                               opts.microbatches, opts.width, opts.isolated_repeats)
        gathered: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(gathered, mine)
        isolated[num_stages] = gathered

    # warm-up, then timed repetitions round-robin over the runners
    for k in range(opts.warmup):
        for runner in runners:
            dist.barrier()
            runner.step(pool[k % len(pool)], target)
    times: dict[str, list[float]] = {r.label: [] for r in runners}
    cpu: dict[str, list[tuple[float, float]]] = {r.label: [] for r in runners}
    dist.barrier()
    window = CpuWindow()
    for k in range(opts.reps):
        for runner in runners:
            x = pool[k % len(pool)]
            dist.barrier()
            c0, m0 = time.process_time(), time.thread_time()
            t0 = time.perf_counter()
            runner.step(x, target)
            t1 = time.perf_counter()
            m1, c1 = time.thread_time(), time.process_time()
            times[runner.label].append(t1 - t0)
            # CPU of the main thread, and of every other thread of the process (receive
            # threads, gloo's device threads, monitors) during the step
            cpu[runner.label].append((m1 - m0, (c1 - c0) - (m1 - m0)))
            runner.after_timed_step()
    dist.barrier()
    window.close()

    # gather everything on rank 0
    mine_all = {
        "times": times,
        "cpu": cpu,
        "cpu_window": window.result,
        "records": {r.label: r.records for r in runners if r.records},
        "scale_seconds": {r.label: r.scale_seconds for r in runners if r.framework == "torch"},
    }
    gathered_all: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered_all, mine_all)
    info: dict[str, Any] = {}
    if rank == 0:
        for runner in runners:
            if runner.framework == "pipetrain":
                info[runner.label] = {"framework": "pipetrain", "schedule": runner.schedule_name,
                                      "num_stages": runner.num_stages,
                                      "stage_to_rank": runner.stage_to_rank,
                                      "pipeline_schedule": runner.pipe.schedule(opts.microbatches)}
            else:
                info[runner.label] = {"framework": "torch", "schedule": runner.schedule_name,
                                      "num_stages": runner.num_stages,
                                      "stage_to_rank": runner.stage_to_rank,
                                      "compute_order": runner.compute_order()}
    for runner in runners:
        runner.close()
    dist.barrier()
    if rank != 0:
        return {}
    return {"runners": info, "gathered": gathered_all, "failures": failures,
            "first_losses": first_losses, "reference_losses": reference, "isolated": isolated}


def _reference_losses(factories: Sequence[Any], pool: Sequence[Any], target: Any) -> list[float]:
    import torch
    from torch import nn

    model = nn.Sequential(*(f() for f in factories))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for k in range(2):
        loss = torch.nn.functional.mse_loss(model(pool[k % len(pool)]), target)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


# ---------------------------------------------------------------------------------------
# analysis of part 1 (rank 0, in the parent)
# ---------------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _quartiles(values: Sequence[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]] if values else [math.nan, math.nan]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def _timeline_analysis(label: str, gathered: Sequence[Any], schedule: Any,
                       step_times: Sequence[float]) -> dict[str, Any]:
    """Measured makespan vs the simulator's prediction from the measured action costs,
    bubble, where the time goes (from each rank's recorded actions of every timed step)."""
    from pipetrain.schedule import TimedAction, simulate
    from pipetrain.trace import aggregate, measure_step, offsets_from_origins

    per_rank = [g["records"][label] for g in gathered]
    measures, predicted, ops_by_rank = [], [], []
    predicted_bubble: list[float] = []
    with_sends: list[float] = []
    for rep in range(len(per_rank[0])):
        origins = [per_rank[r][rep][0] for r in range(WORLD_SIZE)]
        offsets = offsets_from_origins(origins)
        timeline = [TimedAction(r, t.action, t.start + offsets[r], t.end + offsets[r])
                    for r in range(WORLD_SIZE) for t in per_rank[r][rep][1]]
        measure = measure_step(timeline, num_ranks=WORLD_SIZE, num_stages=schedule.num_stages)
        measures.append(measure)
        simulated = simulate(schedule, measure.mean_costs)
        predicted.append(simulated.makespan)
        predicted_bubble.append(simulated.bubble_fraction)
        with_sends.append(simulate(schedule, _with_send_costs(measure.mean_costs, timeline,
                                                              schedule.num_stages)).makespan)
        totals: list[dict[str, float]] = [{} for _ in range(WORLD_SIZE)]
        for t in timeline:
            op = t.action.op.value
            totals[t.rank][op] = totals[t.rank].get(op, 0.0) + (t.end - t.start)
        ops_by_rank.append(totals)
    summary = aggregate(measures)
    makespans = [m.makespan for m in measures]
    gaps = [m / p - 1.0 for m, p in zip(makespans, predicted)]
    op_names = sorted({op for rep in ops_by_rank for totals in rep for op in totals})
    op_medians = [
        {op: _median([rep[r].get(op, 0.0) for rep in ops_by_rank]) for op in op_names}
        for r in range(WORLD_SIZE)
    ]
    costs = summary.mean_costs.per_stage(schedule.num_stages)
    return {
        "measured_makespan_s": _median(makespans),
        "predicted_makespan_s": _median(predicted),
        "gap": _median(makespans) / _median(predicted) - 1.0,
        "median_gap_per_step": _median(gaps),
        "outside_actions_s": _median([s - m for s, m in zip(step_times, makespans)]),
        "predicted_with_send_costs_s": _median(with_sends),
        "gap_with_send_costs": _median(makespans) / _median(with_sends) - 1.0,
        "bubble_measured": summary.bubble_fraction,
        "bubble_predicted": _median(predicted_bubble),
        "busy_s_per_rank": list(summary.busy),
        "wait_s_per_rank": list(summary.wait),
        "op_seconds_per_rank": op_medians,
        "measured_costs_s": {
            "forward": list(costs.forward), "backward": list(costs.backward),
            "backward_input": list(costs.backward_input),
            "backward_weight": list(costs.backward_weight),
            "communication": list(costs.communication), "step": list(costs.step),
        },
    }


def _with_send_costs(costs: Any, timeline: Sequence[Any], num_stages: int) -> Any:
    """``costs`` with each stage's mean send time (SF, SB: packing and posting a message on
    the sender, which the simulator counts as free) added to the compute that precedes it."""
    from pipetrain.schedule import Costs, Op

    per_stage = costs.per_stage(num_stages)
    sends: dict[Op, list[list[float]]] = {Op.SEND_FORWARD: [[] for _ in range(num_stages)],
                                          Op.SEND_BACKWARD: [[] for _ in range(num_stages)]}
    for t in timeline:
        if t.action.op in sends:
            sends[t.action.op][t.action.stage].append(t.end - t.start)
    sf = [statistics.fmean(v) if v else 0.0 for v in sends[Op.SEND_FORWARD]]
    sb = [statistics.fmean(v) if v else 0.0 for v in sends[Op.SEND_BACKWARD]]
    return Costs(
        forward=tuple(f + s for f, s in zip(per_stage.forward, sf)),
        backward=tuple(b + s for b, s in zip(per_stage.backward, sb)),
        backward_input=tuple(b + s for b, s in zip(per_stage.backward_input, sb)),
        backward_weight=per_stage.backward_weight,
        communication=per_stage.communication,
        reduce=per_stage.reduce,
        step=per_stage.step,
    )


def analyse_mlp(raw: dict[str, Any], opts: Any) -> dict[str, Any]:
    from pipetrain.schedule import build_schedule, default_stages_per_rank

    gathered = raw["gathered"]
    runners = raw["runners"]
    isolated = {n: _merge_costs(per_rank, n) for n, per_rank in raw["isolated"].items()}
    rows: dict[str, Any] = {}
    for label, info in runners.items():
        step_times = [max(g["times"][label][k] for g in gathered)
                      for k in range(len(gathered[0]["times"][label]))]
        med = _median(step_times)
        row: dict[str, Any] = {
            "framework": info["framework"],
            "schedule": info["schedule"],
            "num_stages": info["num_stages"],
            "stage_to_rank": list(info["stage_to_rank"]),
            "median_s": med,
            "quartiles_s": _quartiles(step_times),
            "min_s": min(step_times),
            "steps_per_s": 1.0 / med,
            "reps": len(step_times),
            "main_thread_cpu_s_per_rank": [_median([c[0] for c in g["cpu"][label]])
                                           for g in gathered],
            "other_threads_cpu_s_per_rank": [_median([c[1] for c in g["cpu"][label]])
                                             for g in gathered],
        }
        costs = isolated[info["num_stages"]]
        if info["framework"] == "pipetrain":
            schedule = info["pipeline_schedule"]
            row.update(_timeline_analysis(label, gathered, schedule, step_times))
        else:
            order = info["compute_order"]
            if label in gathered[0]["records"]:
                # what torch actually ran (its single-stage schedules do not run their
                # pipeline_order, which can be off: Schedule1F1B's lists micro-batch M)
                order = [[(t.action.op.value, t.action.stage, t.action.microbatch)
                          for t in g["records"][label][0][1] if t.action.op.is_compute]
                         for g in gathered]
            try:
                schedule = _torch_schedule_as_pipetrain(
                    order, name=label, num_microbatches=opts.microbatches,
                    stage_to_rank=info["stage_to_rank"])
                ours = build_schedule(
                    info["schedule"], num_ranks=WORLD_SIZE, num_microbatches=opts.microbatches,
                    stages_per_rank=default_stages_per_rank(info["schedule"]),
                    optimizer_step=True, reduce=True)
                row["same_order_as_pipetrain"] = (
                    info["num_stages"] == ours.num_stages
                    and [[a for a in acts if a.op.is_compute] for acts in schedule.actions]
                    == [[a for a in acts if a.op.is_compute] for acts in ours.actions])
            except Exception as exc:
                schedule = None
                row["ideal_error"] = f"{type(exc).__name__}: {exc}"
            if schedule is not None and label in gathered[0]["records"]:
                row.update(_timeline_analysis(label, gathered, schedule, step_times))
                row["scale_grads_s"] = _median([max(g["scale_seconds"][label][k] for g in gathered)
                                                for k in range(len(step_times))])
        if schedule is not None:
            row.update(_ideal(schedule, costs))
            row["over_ideal"] = med / row["ideal_s"] - 1.0
            row["over_floor"] = med / row["floor_s"] - 1.0
        rows[label] = row

    first = raw["first_losses"]
    reference = raw["reference_losses"]
    per_schedule: dict[str, Any] = {}
    for schedule in opts.schedules:
        ours = rows.get(schedule)
        torch_rows = {label: r for label, r in rows.items()
                      if r["framework"] == "torch" and r["schedule"] == schedule}
        entry: dict[str, Any] = {"pipetrain": ours, "torch": torch_rows,
                                 "torch_not_comparable": {
                                     label: reason for label, reason in raw["failures"].items()
                                     if label in {v[0] for v in TORCH_VARIANTS[schedule]}}}
        ours_losses = first.get(f"pipetrain:{schedule}")
        diffs = {}
        for label in torch_rows:
            if ours_losses is not None and label in first:
                diffs[label] = max(abs(a - b) for a, b in zip(ours_losses, first[label]))
        entry["first_losses"] = {"pipetrain": ours_losses,
                                 **{label: first[label] for label in torch_rows if label in first}}
        entry["max_loss_diff_vs_torch"] = diffs
        if ours_losses is not None:
            entry["max_loss_diff_vs_single_process"] = max(
                abs(a - b) for a, b in zip(ours_losses, reference))
        if ours is not None and torch_rows:
            best = min(torch_rows.values(), key=lambda r: r["median_s"])
            best_label = next(label for label, r in torch_rows.items() if r is best)
            entry["torch_best"] = best_label
            entry["ratio"] = best["median_s"] / ours["median_s"]
            entry["ratios"] = {label: r["median_s"] / ours["median_s"]
                               for label, r in torch_rows.items()}
            if "ideal_s" in ours:
                # the best ratio pipetrain could reach with zero overhead (its step = ideal)
                entry["ratio_bound"] = best["median_s"] / ours["ideal_s"]
        per_schedule[schedule] = entry
    return {"schedules": per_schedule, "reference_losses": reference,
            "load_during_timing": foreign_load([g["cpu_window"] for g in gathered]),
            "isolated_costs_s": {str(n): c for n, c in isolated.items()}}


# ---------------------------------------------------------------------------------------
# part 2: the GPT, pipeline on 2 ranks vs one process
# ---------------------------------------------------------------------------------------


def gpt_worker(ctx: Any, opts: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.data import TextDataset, load_corpus
    from pipetrain.models import GPTConfig, build_gpt, gpt_layer_factories, gpt_loss, gpt_ties

    rank = dist.get_rank()
    config = GPTConfig(num_layers=4, width=64, num_heads=4, context=128)

    def adamw(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)

    dataset = TextDataset(load_corpus(max_bytes=2_000_000), context=config.context, seed=0)
    pipe = Pipeline(gpt_layer_factories(config, seed=0), loss_fn=gpt_loss, optimizer=adamw,
                    ties=gpt_ties(config),
                    config=PipelineConfig(schedule="1f1b", num_stages=2, num_microbatches=8,
                                          clip_grad_norm=1.0),
                    context=ctx)
    model = optimizer = None
    if rank == 0:
        model = build_gpt(config, seed=0)
        optimizer = adamw(model.parameters())

    def single_step(x: Any, y: Any) -> float:
        assert model is not None and optimizer is not None
        loss = gpt_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    pipe_times: list[float] = []
    pipe_cpu: list[tuple[float, float]] = []
    single_times: list[float] = []
    single_cpu: list[float] = []  # the idle rank's CPU time while rank 0 trains alone
    losses: dict[str, list[float]] = {"pipeline": [], "single": []}
    records: list[Any] = []
    window = None
    for k in range(opts.gpt_warmup + opts.gpt_reps):
        timed = k >= opts.gpt_warmup
        if k == opts.gpt_warmup:
            dist.barrier()
            window = CpuWindow()
        x, y = dataset.batch(k, 32)
        dist.barrier()
        c0, m0 = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        loss = pipe.train_step(x, y)
        t1 = time.perf_counter()
        m1, c1 = time.thread_time(), time.process_time()
        if k < 2:
            losses["pipeline"].append(loss)
        if timed:
            pipe_times.append(t1 - t0)
            pipe_cpu.append((m1 - m0, (c1 - c0) - (m1 - m0)))
            records.append((pipe.last_step_start, list(pipe.last_timeline)))
        dist.barrier()
        c0 = time.process_time()
        if rank == 0:
            t0 = time.perf_counter()
            value = single_step(x, y)
            t1 = time.perf_counter()
            if k < 2:
                losses["single"].append(value)
            if timed:
                single_times.append(t1 - t0)
        dist.barrier()
        if timed and rank == 1:
            single_cpu.append(time.process_time() - c0)
    dist.barrier()
    cpu_window = window.close() if window is not None else {}
    schedule = pipe.schedule(8)
    pipe.close()
    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, {"times": pipe_times, "records": records, "cpu": pipe_cpu,
                                      "single_cpu": single_cpu, "cpu_window": cpu_window})
    if rank != 0:
        return {}
    return {"gathered": gathered, "single_times": single_times, "losses": losses,
            "schedule": schedule}


def analyse_gpt(raw: dict[str, Any]) -> dict[str, Any]:
    gathered = raw["gathered"]
    pipe_times = [max(g["times"][k] for g in gathered) for k in range(len(gathered[0]["times"]))]
    single = raw["single_times"]
    analysis = _timeline_analysis("gpt", [{"records": {"gpt": g["records"]}} for g in gathered],
                                   raw["schedule"], pipe_times)
    losses = raw["losses"]
    return {
        "pipeline_median_s": _median(pipe_times),
        "pipeline_quartiles_s": _quartiles(pipe_times),
        "single_median_s": _median(single),
        "single_quartiles_s": _quartiles(single),
        "speedup": _median(single) / _median(pipe_times),
        "ideal_speedup": 2.0,
        "tokens_per_s_pipeline": 32 * 128 / _median(pipe_times),
        "tokens_per_s_single": 32 * 128 / _median(single),
        "first_losses": losses,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["pipeline"], losses["single"])),
        "idle_rank_cpu_s_during_single": _median(gathered[1]["single_cpu"]),
        "main_thread_cpu_s_per_rank": [_median([c[0] for c in g["cpu"]]) for g in gathered],
        "other_threads_cpu_s_per_rank": [_median([c[1] for c in g["cpu"]]) for g in gathered],
        "reps": len(pipe_times),
        "load_during_timing": foreign_load([g["cpu_window"] for g in gathered]),
        # the pipeline's compute (both ranks' F + B + STEP) against the single process's step:
        # what micro-batching and the pipeline add to the work itself
        "pipeline_busy_sum_s": sum(analysis["busy_s_per_rank"]),
        "compute_inflation": sum(analysis["busy_s_per_rank"]) / _median(single) - 1.0,
        # the speedup with the pipeline's own compute, were it free of bubbles and overhead
        "speedup_bound_balanced": _median(single) / (sum(analysis["busy_s_per_rank"]) / 2),
        "speedup_bound_busiest_rank": _median(single) / max(analysis["busy_s_per_rank"]),
        "pipetrain": analysis,
    }


# ---------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{1e3 * seconds:7.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:+.1f}%"


def _load_line(load: dict[str, Any]) -> str:
    other = load.get("other_cores")
    ours = load.get("our_cores")
    text = "unknown (no /proc/stat)" if other is None else f"{other:.2f} cores"
    return (f"machine load during the timed loop: other processes {text}, ours "
            f"{ours:.2f} cores, of {os.cpu_count()}")


def _stage_ms(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{1e3 * v:.2f}" for v in values) + "]"


def print_mlp(result: dict[str, Any], opts: Any) -> None:
    print(f"\n== Part 1: MLP {opts.depth} x [Linear({opts.width},{opts.width})+GELU], batch "
          f"{opts.batch}, {opts.microbatches} micro-batches, SGD, 2 ranks x 1 thread ==")
    print(f"medians over {opts.reps} round-robin repetitions (after {opts.warmup} warm-up), "
          "max over ranks; ms per training step")
    print(_load_line(result["load_during_timing"]) + "\n")
    header = (f"{'schedule':17} {'pipetrain':>9} {'torch':>9} {'steps/s':>11} {'ratio':>6} "
              f"{'bound':>6}  {'predicted':>9} {'measured':>8} {'gap':>7}  {'bubble':>6}  "
              "torch schedule")
    print(header)
    print("-" * len(header))
    for schedule, entry in result["schedules"].items():
        ours = entry["pipetrain"]
        torch_best = entry.get("torch_best")
        t = entry["torch"].get(torch_best) if torch_best else None
        ratio = f"{entry['ratio']:.2f}x" if t else "-"
        bound = f"{entry['ratio_bound']:.2f}x" if "ratio_bound" in entry else "-"
        rates = f"{ours['steps_per_s']:.2f}/" + (f"{t['steps_per_s']:.2f}" if t else "-")
        print(f"{schedule:17} {_ms(ours['median_s']):>9} {_ms(t['median_s'] if t else None):>9} "
              f"{rates:>11} {ratio:>6} {bound:>6}  "
              f"{_ms(ours['predicted_makespan_s']):>9} {_ms(ours['measured_makespan_s']):>8} "
              f"{_pct(ours['gap']):>7}  {ours['bubble_measured']:6.1%}  "
              f"{torch_best or 'torch: not comparable'}")
        for label, row in entry["torch"].items():
            if label != torch_best:
                print(f"{'':17} {'':>9} {_ms(row['median_s']):>9} "
                      f"{'-/' + format(row['steps_per_s'], '.2f'):>11} "
                      f"{entry['ratios'][label]:5.2f}x {'':>6}  {'':>9} {'':>8} {'':>7}  "
                      f"{'':>6}  {label}")
        for label, reason in entry["torch_not_comparable"].items():
            print(f"{'':17} torch: not comparable ({label}: {reason})")
    print("\nsteps/s = pipetrain/torch; ratio = torch step time / pipetrain step time (> 1: "
          "pipetrain faster; goal >= "
          f"{GOAL_RATIO}x),\nagainst the fastest torch variant; bound = torch / pipetrain's ideal "
          "step (below),\nthe best ratio a zero-overhead pipetrain could reach. predicted = simulate(pipetrain's "
          "schedule, costs measured in the same steps);\nmeasured = makespan of the recorded "
          f"actions (goal: within {GOAL_GAP:.0%}); bubble = measured idle share of both ranks.")

    print("\nSame work? losses of the first two steps (same initial weights, same batches):")
    print(f"  single process reference: {result['reference_losses']}")
    for schedule, entry in result["schedules"].items():
        diffs = ", ".join(f"{label} {d:.1e}" for label, d in entry["max_loss_diff_vs_torch"].items())
        print(f"  {schedule:17} max |pipetrain - torch| = {diffs or '-'}; "
              f"|pipetrain - single process| = {entry.get('max_loss_diff_vs_single_process', 0):.1e}")

    print("\nEach framework against its own recorded actions (torch: its stages' forward / "
          "backward calls timed) and against an ideal step\n(its own action order simulated "
          "with per-stage costs measured in isolation, no communication), ms:")
    print(f"  {'':40} {'step':>6} {'actions':>7} {'outside':>7} {'busy':>6} {'sim':>6} "
          f"{'gap':>7} {'ideal':>6} {'over':>7}")
    for schedule, entry in result["schedules"].items():
        for label, row in [(f"pipetrain {schedule}", entry["pipetrain"])] + [
                (f"torch {label}", row) for label, row in entry["torch"].items()]:
            busy = max(row["busy_s_per_rank"]) if "busy_s_per_rank" in row else None
            print(f"  {label:40} {_ms(row['median_s']):>6} "
                  f"{_ms(row.get('measured_makespan_s')):>7} "
                  f"{_ms(row.get('outside_actions_s')):>7} {_ms(busy):>6} "
                  f"{_ms(row.get('predicted_makespan_s')):>6} {_pct(row.get('gap')):>7} "
                  f"{_ms(row.get('ideal_s')):>6} {_pct(row.get('over_ideal')):>7}"
                  + ("" if row.get("same_order_as_pipetrain") is None else
                     "  (same order as pipetrain)" if row["same_order_as_pipetrain"] else
                     "  (its own order)")
                  + (f"  [no simulation: {row['ideal_error']}]" if "ideal_error" in row else ""))
    print("  step = median step time; actions = makespan of the recorded compute (pipetrain: "
          "all) actions; outside = step - actions;\n  busy = busiest rank's compute + optimizer;"
          " sim = simulated makespan from the measured costs, gap = actions vs sim;\n  ideal = "
          "isolated-cost simulation, over = step vs ideal.")
    for n, c in result["isolated_costs_s"].items():
        print(f"  isolated costs, {n} stages (ms): F {_stage_ms(c['forward'])} "
              f"B {_stage_ms(c['backward'])} SGD {_stage_ms(c['step'])}")

    print("\nWhere the time goes (median ms per step, per rank; per-stage means in ms):")
    for schedule, entry in result["schedules"].items():
        rows = [(f"pipetrain {schedule}", entry["pipetrain"])] + [
            (f"torch {label}", row) for label, row in entry["torch"].items()]
        for label, row in rows:
            if "op_seconds_per_rank" not in row:
                continue
            mc = row["measured_costs_s"]
            extra = ""
            if "predicted_with_send_costs_s" in row and row["framework"] == "pipetrain":
                extra = (f"; sim incl. send time {_ms(row['predicted_with_send_costs_s']).strip()}"
                         f" ({_pct(row['gap_with_send_costs'])})")
            if "scale_grads_s" in row:
                extra += f"; scale_grads {_ms(row['scale_grads_s']).strip()}"
            print(f"  {label}: F {_stage_ms(mc['forward'])} B {_stage_ms(mc['backward'])}"
                  + (f" I {_stage_ms(mc['backward_input'])} W {_stage_ms(mc['backward_weight'])}"
                     if "I" in row["op_seconds_per_rank"][0] or "I" in row["op_seconds_per_rank"][1]
                     else "")
                  + (f" latency {_stage_ms(mc['communication'])}"
                     if row["framework"] == "pipetrain" else "") + extra)
            for r, ops in enumerate(row["op_seconds_per_rank"]):
                text = " ".join(f"{op} {1e3 * v:.1f}" for op, v in sorted(ops.items()))
                print(f"    rank {r}: {text}; CPU: main thread "
                      f"{1e3 * row['main_thread_cpu_s_per_rank'][r]:.1f}, other threads "
                      f"{1e3 * row['other_threads_cpu_s_per_rank'][r]:.1f}")


def print_gpt(result: dict[str, Any]) -> None:
    print("\n== Part 2: GPT (pipetrain train's default: 4 layers, width 64, 4 heads, context "
          "128), batch 32, AdamW, clip 1.0 ==")
    print(f"pipetrain 1f1b, 2 ranks x 1 thread, 8 micro-batches: {_ms(result['pipeline_median_s'])}"
          f" ms/step (IQR {_ms(result['pipeline_quartiles_s'][0]).strip()}-"
          f"{_ms(result['pipeline_quartiles_s'][1]).strip()})")
    print(f"one process x 1 thread (plain PyTorch):              {_ms(result['single_median_s'])}"
          f" ms/step (IQR {_ms(result['single_quartiles_s'][0]).strip()}-"
          f"{_ms(result['single_quartiles_s'][1]).strip()})")
    p = result["pipetrain"]
    print(_load_line(result["load_during_timing"]))
    print(f"speedup {result['speedup']:.2f}x (ideal 2x); medians over {result['reps']} "
          f"alternating steps; first-steps loss diff {result['max_loss_diff']:.1e}")
    print(f"pipeline: actions' makespan {_ms(p['measured_makespan_s']).strip()} ms vs simulated "
          f"{_ms(p['predicted_makespan_s']).strip()} ms from its measured costs "
          f"({_pct(p['gap'])}; with send time {_ms(p['predicted_with_send_costs_s']).strip()} ms, "
          f"{_pct(p['gap_with_send_costs'])}); outside actions "
          f"{_ms(p['outside_actions_s']).strip()} ms; bubble {p['bubble_measured']:.1%}")
    print(f"  busy (F + B + STEP) per rank {[round(1e3 * b, 1) for b in p['busy_s_per_rank']]} ms,"
          f" together {_ms(result['pipeline_busy_sum_s']).strip()} ms = "
          f"{_pct(result['compute_inflation'])} vs the single process's step; per micro-batch F "
          f"{_stage_ms(p['measured_costs_s']['forward'])} B "
          f"{_stage_ms(p['measured_costs_s']['backward'])} STEP "
          f"{_stage_ms(p['measured_costs_s']['step'])} ms per stage")
    print(f"  speedup bounds from that compute: balanced and bubble-free "
          f"{result['speedup_bound_balanced']:.2f}x, busiest rank alone "
          f"{result['speedup_bound_busiest_rank']:.2f}x")
    for r, ops in enumerate(p["op_seconds_per_rank"]):
        text = " ".join(f"{op} {1e3 * v:.1f}" for op, v in sorted(ops.items()))
        print(f"    rank {r}: {text}; CPU: main thread "
              f"{1e3 * result['main_thread_cpu_s_per_rank'][r]:.1f}, other threads "
              f"{1e3 * result['other_threads_cpu_s_per_rank'][r]:.1f}")
    print(f"  (rank 1's CPU while rank 0 ran the single-process step: "
          f"{_ms(result['idle_rank_cpu_s_during_single']).strip()} ms)")


def machine_info() -> dict[str, Any]:
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": list(load) if load else None,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--gpt", action="store_true", help="run only part 2 (GPT speedup)")
    part.add_argument("--mlp", action="store_true", help="run only part 1 (vs torch)")
    parser.add_argument("--reps", type=int, default=25, help="timed repetitions (default 25)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps (default 5)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated subset of {','.join(SCHEDULES)}")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--gpt-reps", type=int, default=None,
                        help="timed GPT steps (default: --reps)")
    parser.add_argument("--gpt-warmup", type=int, default=None,
                        help="GPT warm-up steps (default: --warmup)")
    parser.add_argument("--isolated-repeats", type=int, default=48,
                        help="micro-batches timed per stage for the isolated costs (default 48)")
    parser.add_argument("--no-trace-torch", dest="trace_torch", action="store_false",
                        help="do not time torch's compute calls (by default each forward / "
                             "backward call of its stages is timed: ~1 us per call)")
    parser.add_argument("--malloc-tuned", action="store_true",
                        help="run the workers with glibc's MALLOC_TRIM_THRESHOLD_=1 GiB and "
                             "MALLOC_MMAP_THRESHOLD_=64 MiB (no page faults on large "
                             "temporaries; both frameworks alike)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before a stuck job is killed (default 600)")
    parser.add_argument("--torch-timeout", type=float, default=60.0,
                        help="timeout of torch's process groups (default 60)")
    opts = parser.parse_args(argv)
    opts.schedules = [s.strip() for s in opts.schedules.split(",") if s.strip()]
    unknown = [s for s in opts.schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"unknown schedule(s) {unknown}; choose from {', '.join(SCHEDULES)}")
    if opts.batch % opts.microbatches:
        parser.error(f"--batch {opts.batch} is not a multiple of --microbatches {opts.microbatches}")
    if opts.depth % 4:
        parser.error(f"--depth {opts.depth} must be a multiple of 4 (2 ranks x up to 2 stages)")
    opts.gpt_reps = opts.reps if opts.gpt_reps is None else opts.gpt_reps
    opts.gpt_warmup = opts.warmup if opts.gpt_warmup is None else opts.gpt_warmup
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    output: dict[str, Any] = {"machine": machine_info(), "config": {
        "reps": opts.reps, "warmup": opts.warmup, "schedules": opts.schedules,
        "width": opts.width, "depth": opts.depth, "batch": opts.batch,
        "microbatches": opts.microbatches, "world_size": WORLD_SIZE, "threads_per_rank": 1,
        "malloc_tuned": opts.malloc_tuned, "trace_torch": opts.trace_torch,
        "gpt_reps": opts.gpt_reps, "gpt_warmup": opts.gpt_warmup}}
    if not opts.json:
        m = output["machine"]
        print(f"machine: {m['cpu_count']} CPUs, torch {m['torch']}, python {m['python']}, "
              f"load average {m['loadavg_start']}")
        if opts.malloc_tuned:
            print("workers run with MALLOC_TRIM_THRESHOLD_=1 GiB, MALLOC_MMAP_THRESHOLD_=64 MiB")
    started = time.perf_counter()
    if not opts.gpt:
        raw = run_job(mlp_worker, opts, timeout=opts.timeout)[0]
        output["mlp"] = analyse_mlp(raw, opts)
        output["mlp"]["seconds"] = time.perf_counter() - started
        if not opts.json:
            print_mlp(output["mlp"], opts)
    if not opts.mlp:
        began = time.perf_counter()
        raw = run_job(gpt_worker, opts, timeout=opts.timeout)[0]
        output["gpt"] = analyse_gpt(raw)
        output["gpt"]["seconds"] = time.perf_counter() - began
        if not opts.json:
            print_gpt(output["gpt"])
    output["machine"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    output["seconds"] = time.perf_counter() - started
    output["goals"] = _goals(output)
    if opts.json:
        print(json.dumps(_finite(output), default=_json_default, allow_nan=False))
    else:
        print(f"\nload average at the end: {output['machine']['loadavg_end']}; "
              f"{output['seconds']:.0f} s in all")
        for line in output["goals"]["lines"]:
            print(line)
    return 0


def _goals(output: dict[str, Any]) -> dict[str, Any]:
    lines = []
    met: dict[str, Any] = {}
    for schedule, entry in output.get("mlp", {}).get("schedules", {}).items():
        ratio = entry.get("ratio")
        gap = entry["pipetrain"]["gap"] if entry.get("pipetrain") else None
        met[schedule] = {"throughput": None if ratio is None else ratio >= GOAL_RATIO,
                         "simulator": None if gap is None else abs(gap) <= GOAL_GAP}
        lines.append(f"goal {schedule:17} throughput >= {GOAL_RATIO}x torch: "
                     f"{'-' if ratio is None else ('met' if ratio >= GOAL_RATIO else 'MISSED')}"
                     f" ({'-' if ratio is None else f'{ratio:.2f}x'}); within {GOAL_GAP:.0%} of "
                     f"the simulator: {'-' if gap is None else ('met' if abs(gap) <= GOAL_GAP else 'MISSED')}"
                     f" ({_pct(gap)})")
    return {"per_schedule": met, "lines": lines}


def _finite(value: Any) -> Any:
    """``value`` with every NaN / infinity replaced by ``None`` (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
