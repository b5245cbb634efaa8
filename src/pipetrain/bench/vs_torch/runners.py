"""One training step of one (framework, schedule): pipetrain's ``Pipeline`` or torch's.

Both frameworks build the same layers from the same seeded factories, cut at the same
layer boundaries, and step the same optimizer. pipetrain: ``Pipeline.train_step`` (which
also returns the mean loss on every rank), its defaults. torch: ``schedule.step(...)`` +
``optimizer.step()`` + ``zero_grad()``, nothing else, at the settings its users would pick
for speed (:data:`TORCH_SETTINGS`): ``scale_grads=False`` with the loss divided by the
number of micro-batches instead (:func:`per_microbatch`: the same gradients without a pass
over every gradient after the last backward), and ``zero_grad(set_to_none=False)``, which
keeps the gradient buffers between steps as pipetrain does (freed buffers come back from
the operating system as fresh pages, page-faulted on the next step's first backward).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TORCH_SETTINGS", "TORCH_VARIANTS", "WORLD_SIZE", "PipetrainRunner", "TorchRunner",
           "per_microbatch", "placement", "stage_ranges"]

WORLD_SIZE = 2

TORCH_SETTINGS = ("scale_grads=False with the loss divided by the micro-batches, "
                  "zero_grad(set_to_none=False) (gradients kept between steps)")
"""How torch's runners are set up, in the words the tables use."""


def per_microbatch(loss_fn: Callable[..., Any], microbatches: int) -> Callable[..., Any]:
    """``loss_fn`` divided by ``microbatches``: what torch's ``scale_grads=True`` does to
    the gradients after the backward, done to the loss before it (the same gradients; the
    loss a step reports is then the mean's ``1 / microbatches``).

    Example:
        >>> per_microbatch(lambda out, target: out - target, 4)(10.0, 2.0)
        2.0
    """
    def scaled(output: Any, target: Any) -> Any:
        return loss_fn(output, target) / microbatches

    return scaled

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


def stage_ranges(num_layers: int, num_stages: int,
                 balance: Sequence[int] | None = None) -> list[range]:
    """The layers of each stage: ``balance`` (layers per stage) or as even as possible.

    Example:
        >>> stage_ranges(10, 2, [4, 6])
        [range(0, 4), range(4, 10)]
    """
    if balance is None:
        base, extra = divmod(num_layers, num_stages)
        balance = [base + (1 if j < extra else 0) for j in range(num_stages)]
    if len(balance) != num_stages or sum(balance) != num_layers:
        raise ValueError(f"balance {list(balance)} does not cut {num_layers} layers into "
                         f"{num_stages} stages")
    ranges, start = [], 0
    for count in balance:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def placement(kind: str, num_stages: int) -> tuple[int, ...]:
    """The rank of each stage: looped or V placement over the benchmark's ranks."""
    from pipetrain.schedule import loop_placement, v_placement

    if kind == "v":
        return v_placement(WORLD_SIZE)
    return loop_placement(WORLD_SIZE, num_stages // WORLD_SIZE)


class PipetrainRunner:
    """pipetrain's ``Pipeline`` for one schedule (``config`` overrides ``PipelineConfig``'s
    defaults, e.g. ``balance``)."""

    framework = "pipetrain"

    def __init__(self, ctx: Any, schedule: str, factories: Sequence[Any], *,
                 microbatches: int, loss_fn: Callable[..., Any],
                 optimizer: Callable[[Any], Any], label: str | None = None,
                 **config: Any) -> None:
        from pipetrain.api.config import PipelineConfig
        from pipetrain.api.pipeline import Pipeline
        from pipetrain.schedule import V_SCHEDULES, default_stages_per_rank

        self.schedule_name = schedule
        self.label = label or schedule
        stages_per_rank = default_stages_per_rank(schedule)
        self.pipe = Pipeline(
            list(factories), loss_fn=loss_fn, optimizer=optimizer,
            config=PipelineConfig(schedule=schedule, num_stages=WORLD_SIZE,
                                  stages_per_rank=stages_per_rank,
                                  num_microbatches=microbatches, **config),
            context=ctx,
        )
        self.num_stages = WORLD_SIZE * stages_per_rank
        self.stage_to_rank = placement("v" if schedule in V_SCHEDULES else "loop",
                                       self.num_stages)
        self.records: list[tuple[float, list[Any]]] = []

    def step(self, x: Any, y: Any) -> float:
        return self.pipe.train_step(x, y)

    def loss(self, value: float) -> float:
        """The mean loss of a step (pipetrain returns it from the step)."""
        return value

    def after_timed_step(self) -> None:
        self.records.append((self.pipe.last_step_start, list(self.pipe.last_timeline)))

    def close(self) -> None:
        self.pipe.close()


class TorchRunner:
    """torch.distributed.pipelining: PipelineStage(s) + a schedule + one optimizer per rank.

    ``trace`` times the compute calls of its stages (two ``perf_counter`` reads and an
    append each), which gives its per-action timeline. ``loss_fn`` is the mean loss of a
    micro-batch; with ``scale_grads=False`` (the default) torch does not divide the
    gradients by the number of micro-batches after the backward, and the runner divides
    the loss instead (:func:`per_microbatch`: the same gradients, one pass over them
    fewer); :meth:`loss` reports the mean either way. ``keep_grads``: ``zero_grad`` keeps
    the gradient buffers (``set_to_none=False``)."""

    framework = "torch"

    def __init__(self, ctx: Any, schedule: str, variant: tuple[str, str, int, str],
                 factories: Sequence[Any], *, microbatches: int,
                 loss_fn: Callable[..., Any], optimizer: Callable[[Any], Any],
                 balance: Sequence[int] | None = None, trace: bool = True,
                 timeout: float = 60.0, scale_grads: bool = False,
                 keep_grads: bool = True) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed import pipelining

        self.schedule_name = schedule
        self.label, class_name, stages_per_rank, kind = variant
        self.num_stages = WORLD_SIZE * stages_per_rank
        self.stage_to_rank = placement(kind, self.num_stages)
        rank = dist.get_rank()
        # its own process group: a failing torch schedule cannot disturb the others
        self.group = dist.new_group(list(range(WORLD_SIZE)),
                                    timeout=datetime.timedelta(seconds=timeout))
        self.local = [j for j in range(self.num_stages) if self.stage_to_rank[j] == rank]
        ranges = stage_ranges(len(factories), self.num_stages, balance)
        self.modules = {j: nn.Sequential(*(factories[i]() for i in ranges[j])) for j in self.local}
        self.stages = [
            pipelining.PipelineStage(self.modules[j], j, self.num_stages, torch.device("cpu"),
                                     group=self.group)
            for j in self.local
        ]
        cls = getattr(pipelining, class_name)
        stages = self.stages[0] if (stages_per_rank == 1 and class_name in (
            "ScheduleGPipe", "Schedule1F1B")) else self.stages
        self.scale_grads = scale_grads
        self.keep_grads = keep_grads
        self.schedule = cls(stages, microbatches, scale_grads=scale_grads,
                            loss_fn=loss_fn if scale_grads else per_microbatch(loss_fn,
                                                                               microbatches))
        params = [p for m in self.modules.values() for p in m.parameters()]
        self.optimizer = optimizer(params)
        self.has_first = 0 in self.local
        self.has_last = self.num_stages - 1 in self.local
        self.microbatches = microbatches
        self.rank = rank
        self._losses: list[Any] = []
        # (stage, op, micro-batch, start, end) of the last step, seconds since its start
        self.events: list[tuple[int, str, int | None, float, float]] = []
        self.records: list[tuple[float, list[Any]]] = []
        self.scale_seconds: list[float] = []
        self._origin = 0.0
        self._wall_origin = 0.0
        if trace:
            for stage in self.stages:
                self._instrument(stage)

    def _timed(self, j: int, name: str | Callable[..., str], call: Callable[..., Any]
               ) -> Callable[..., Any]:
        clock = time.perf_counter
        events = self.events

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return call(*args, **kwargs)
            finally:
                op = name if isinstance(name, str) else name(kwargs)
                chunk = args[0] if args and isinstance(args[0], int) else None
                events.append((j, op, chunk if op not in ("SCALE",) else None, start, clock()))

        return timed

    def _instrument(self, stage: Any) -> None:
        """Time the stage's compute calls."""
        j = stage.stage_index
        stage.forward_one_chunk = self._timed(j, "F", stage.forward_one_chunk)
        stage.backward_one_chunk = self._timed(
            j, lambda kw: "B" if kw.get("full_backward", True) else "I", stage.backward_one_chunk)
        stage.backward_weight_one_chunk = self._timed(j, "W", stage.backward_weight_one_chunk)
        stage.scale_grads = self._timed(j, "SCALE", stage.scale_grads)
        stage.perform_reduce_grad = self._timed(j, "SCALE", stage.perform_reduce_grad)

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
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
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

    def loss(self, value: Any = None) -> float:
        """The mean loss of the last step on every rank (a collective, outside the timing)."""
        import torch
        import torch.distributed as dist

        local = torch.zeros((), dtype=torch.float64)
        if self.has_last:
            total = sum(float(v.detach()) for v in self._losses)
            # the losses were divided by M before the backward unless torch scaled the grads
            local += total / self.microbatches if self.scale_grads else total
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
