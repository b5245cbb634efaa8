"""The zero-overhead reference: plain autograd running a schedule's own order, no pipeline.

:class:`PlainOrder` runs this rank's compute actions of a schedule (forward, backward,
optimizer step per stage) with plain autograd on the same layers and cut, in the same
order, with no communication: a stage after the first reads a fixed activation of the
right shape, a stage before the last starts its backward from a gradient of ones. Timed
in the same round-robin loop as the pipelines, with both ranks computing at once, its
per-stage costs see what the pipelines' actions see (the machine's speed at that moment,
the other rank's use of the shared caches and memory, the working set of this rank's
stages and held activations in this order), and nothing a pipeline adds to them.
:func:`order_costs` picks the costs for a runner's ideal step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["PlainOrder", "beside_pipelines", "gather_plain_costs", "order_costs"]


class PlainOrder:
    """This rank's part of ``schedule`` with plain autograd: per-stage forward, backward
    and optimizer-step costs, medians over the timed steps (:meth:`costs`).

    A split backward (``I``) runs the whole backward; its ``W`` runs nothing.

    Example (on every rank, beside the pipelines, before :func:`~pipetrain.bench.harness.interleave`)::

        plain = PlainOrder(runner.pipe.schedule(8), factories, rank=rank, loss_fn=loss,
                           optimizer=sgd, example=x)
    """

    framework = "plain"

    def __init__(self, schedule: Any, factories: Sequence[Callable[[], Any]], *, rank: int,
                 loss_fn: Callable[..., Any], optimizer: Callable[[Any], Any], example: Any,
                 balance: Sequence[int] | None = None) -> None:
        import torch
        from torch import nn

        from pipetrain.bench.vs_torch.runners import stage_ranges

        self.schedule_name = schedule.name
        self.label = f"plain {schedule.name}"
        self.stage_to_rank = tuple(schedule.stage_to_rank)
        self.num_stages = schedule.num_stages
        self.microbatches = schedule.num_microbatches
        self.actions = [(a.op.value, a.stage, a.microbatch) for a in schedule.actions[rank]
                        if a.op.is_compute]
        ranges = stage_ranges(len(factories), self.num_stages, balance)
        local = sorted({j for _, j, _ in self.actions})
        self.modules = {j: nn.Sequential(*(factories[i]() for i in ranges[j])) for j in local}
        self.optimizers = {j: optimizer(list(m.parameters())) for j, m in self.modules.items()}
        self.loss_fn = loss_fn
        # each stage's input on a micro-batch of ``example`` (the earlier stages run once)
        self.inputs: dict[int, Any] = {}
        with torch.no_grad():
            h = example.chunk(self.microbatches)[0]
            for j, r in enumerate(ranges[:max(local) + 1]):
                self.inputs[j] = h
                if j < max(local):
                    h = (self.modules[j] if j in self.modules
                         else nn.Sequential(*(factories[i]() for i in r)))(h)
        self._now: dict[str, dict[int, list[float]]] = {}
        self._steps: list[dict[str, dict[int, list[float]]]] = []

    def step(self, x: Any, y: Any) -> None:
        """Run this rank's actions once, timing each."""
        import torch

        xs, ys = x.chunk(self.microbatches), y.chunk(self.microbatches)
        last = self.num_stages - 1
        held: dict[tuple[int, int], Any] = {}
        now: dict[str, dict[int, list[float]]] = {"forward": {}, "backward": {}, "step": {}}
        for op, j, i in self.actions:
            start = time.perf_counter()
            if op == "F":
                inp = xs[i] if j == 0 else self.inputs[j].detach().requires_grad_(True)
                out = self.modules[j](inp)
                held[(j, i)] = self.loss_fn(out, ys[i]) if j == last else out
                name = "forward"
            elif op in ("B", "I"):
                out = held.pop((j, i))
                out.backward(None if j == last else torch.ones_like(out))
                name = "backward"
            else:  # W: the whole backward ran at I
                continue
            now[name].setdefault(j, []).append(time.perf_counter() - start)
        for j, opt in self.optimizers.items():
            start = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=False)
            now["step"][j] = [time.perf_counter() - start]
        self._now = now

    def after_timed_step(self) -> None:
        self._steps.append(self._now)

    def costs(self) -> dict[str, dict[int, float]]:
        """Per-stage median seconds of this rank's stages over the timed steps."""
        return {name: {j: statistics.median(v for s in self._steps for v in s[name][j])
                       for j in self._steps[0][name]}
                for name in ("forward", "backward", "step")} if self._steps else {}


def beside_pipelines(runners: Sequence[Any], make: Callable[[Any], PlainOrder]
                     ) -> tuple[list[Any], list[PlainOrder]]:
    """``runners`` with ``make(runner)`` after each pipetrain runner (timed right after it),
    and the plain runners made."""
    ordered: list[Any] = []
    plains: list[PlainOrder] = []
    for runner in runners:
        ordered.append(runner)
        if getattr(runner, "framework", None) == "pipetrain":
            plains.append(make(runner))
            ordered.append(plains[-1])
    return ordered, plains


def gather_plain_costs(plains: Sequence[PlainOrder]) -> dict[str, dict[str, Any]]:
    """Every rank's :meth:`PlainOrder.costs` merged, by schedule name (a collective: every
    rank calls it with the same runners): per-stage lists and the placement."""
    from pipetrain.bench.harness import gather_objects
    from pipetrain.bench.vs_torch.costs import merge_costs

    per_rank = gather_objects({p.schedule_name: p.costs() for p in plains})
    return {p.schedule_name: {"stage_to_rank": list(p.stage_to_rank),
                              **merge_costs([r[p.schedule_name] for r in per_rank], p.num_stages)}
            for p in plains}


def order_costs(plain: Mapping[str, Mapping[str, Any]], schedule: str,
                stage_to_rank: Sequence[int]) -> dict[str, list[float]] | None:
    """The plain costs for a runner of ``schedule`` placed ``stage_to_rank``: those of the
    same schedule's order, else those of an order with the same placement (a torch
    variant with its own order), else ``None``.

    ``plain``: by schedule name, ``{"stage_to_rank": [...], "forward": [...], ...}``.

    Example:
        >>> plain = {"zb-v": {"stage_to_rank": [0, 1, 1, 0], "forward": [1.0] * 4}}
        >>> order_costs(plain, "zb-h1", [0, 1, 1, 0])["forward"]
        [1.0, 1.0, 1.0, 1.0]
        >>> order_costs(plain, "zb-h1", [0, 1]) is None
        True
    """
    ordered = [schedule, *sorted(plain)]
    for name in ordered:
        found = plain.get(name)
        if found is not None and list(found["stage_to_rank"]) == list(stage_to_rank):
            return {k: list(v) for k, v in found.items() if k != "stage_to_rank"}
    return None
