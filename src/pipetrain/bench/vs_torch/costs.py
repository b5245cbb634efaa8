"""The yardstick: costs measured in isolation, and the ideal step simulated from them.

:func:`measure_costs` times a module's forward and backward on a micro-batch and its
optimizer step with plain autograd, as a step runs them (``M`` forwards and backwards
accumulating into gradients kept between steps, then one optimizer step), in the calling
process alone: no pipeline, no
communication. :func:`ideal` simulates a schedule with such costs: the step a pipeline
with zero overhead would take. :func:`torch_schedule_as_pipetrain` turns the order torch
ran into a pipetrain schedule, so that torch is measured against the same yardstick.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["ideal", "measure_costs", "merge_costs", "stage_costs_from_layers",
           "torch_schedule_as_pipetrain"]


def measure_costs(module: Any, batch: Callable[[], tuple[Any, Any]], *,
                  loss_fn: Callable[..., Any] | None, optimizer: Callable[[Any], Any],
                  microbatches: int, rounds: int) -> dict[str, float]:
    """Median forward and backward seconds of ``module`` on a micro-batch, and of its
    optimizer step after ``microbatches`` accumulations (one warm-up round first).

    ``batch()`` gives ``(input, target)``, a fresh input each call (one that requires
    grad for a stage after the first): with ``loss_fn`` the backward starts from
    ``loss_fn(output, target)``, else from a gradient of ones.
    """
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    opt = optimizer(params) if params else None
    forward, backward, step = [], [], []
    for k in range(rounds + 1):
        for _ in range(microbatches):
            x, target = batch()
            t0 = time.perf_counter()
            out = module(x)
            loss = loss_fn(out, target) if loss_fn is not None else None
            t1 = time.perf_counter()
            if loss is not None:
                loss.backward()
            else:
                out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            if k > 0:  # the first round warms up
                forward.append(t1 - t0)
                backward.append(t2 - t1)
        t2 = time.perf_counter()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=False)  # gradients kept, as both frameworks run
        if k > 0:
            step.append(time.perf_counter() - t2)
    return {"forward": statistics.median(forward), "backward": statistics.median(backward),
            "step": statistics.median(step)}


def merge_costs(per_rank: Sequence[Mapping[str, Mapping[int, float]]],
                num_stages: int) -> dict[str, list[float]]:
    """Per-stage cost lists from every rank's ``{name: {stage: seconds}}``."""
    merged: dict[str, list[float]] = {}
    for name in ("forward", "backward", "step"):
        values: dict[int, float] = {}
        for costs in per_rank:
            values.update({int(j): v for j, v in costs[name].items()})
        merged[name] = [values[j] for j in range(num_stages)]
    return merged


def stage_costs_from_layers(layers: Sequence[Mapping[str, float]],
                            ranges: Sequence[range]) -> dict[str, list[float]]:
    """Per-stage costs as the sums of their layers' costs.

    Example:
        >>> layer = {"forward": 1.0, "backward": 2.0, "step": 0.5}
        >>> stage_costs_from_layers([layer] * 3, [range(0, 1), range(1, 3)])["backward"]
        [2.0, 4.0]
    """
    return {name: [sum(layers[i][name] for i in r) for r in ranges]
            for name in ("forward", "backward", "step")}


def ideal(schedule: Any, costs: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Simulated step (no communication) and the busiest rank's compute under ``costs``."""
    from pipetrain.schedule import Costs, simulate

    c = Costs(forward=tuple(costs["forward"]), backward=tuple(costs["backward"]),
              step=tuple(costs["step"]))
    result = simulate(schedule, c)
    return {"ideal_s": result.makespan, "floor_s": max(result.busy),
            "ideal_bubble": result.bubble_fraction}


def torch_schedule_as_pipetrain(order: list[list[tuple[str, int, int]]], *, name: str,
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
