"""A plan's step, simulated: the schedule the pipeline runs, timed with the profile's costs.

For a plan (its stages' loads per micro-batch and their replica counts) and a
:class:`~pipetrain.plan.costs_pipetrain.Candidate`, :func:`simulate_step` builds the
schedule the runtime runs for it (``build_schedule`` with sends and receives, the
gradient all-reduce and the optimizer step, as ``Pipeline`` builds it) and times it with
:func:`pipetrain.schedule.simulate` under these per-stage costs (:func:`step_costs`):

- forward ``F``; backward ``B`` (the whole backward as one pass); its halves ``I`` and
  ``W`` for the zero-bubble schedules; a re-materialized forward adds ``F`` to the
  backward (or to ``I``), spread evenly over the stage's micro-batches with
  ``except_last`` (which recomputes all but one);
- a message between stages arrives ``bytes / bandwidth`` after its send: one latency per
  stage, for the larger of its input and output activations (exact when they are the
  same size, as between transformer blocks; an upper bound otherwise);
- a replicated stage's gradient all-reduce, ring: ``2 (r - 1) / r * G / bandwidth``,
  in the background until its optimizer step; under FSDP, the schedule's ``UNSHARD``
  (an all-gather of the parameters, ``(r - 1) / r * P / bandwidth``, in the background
  until the stage's first compute action) and ``REDUCE`` (a reduce-scatter, ``(r - 1) /
  r * G / bandwidth``);
- the optimizer step, as profiled; the runtime first checks the global gradient norm
  with one collective over all stages, so every stage's step starts once every stage has
  finished its backward and all-reduce (:func:`synchronized_end`).

Messages overlap compute in the simulation; but a stage's link carries its input and
output activations (and their gradients, the other way) for each of its micro-batches,
``n (I + O)`` bytes each way per step, and a step cannot be shorter than that takes at
the bandwidth. :func:`predicted_step` is the larger of the two: the predicted time per
step.

Example:
    >>> from pipetrain.plan.costs import StageLoad
    >>> from pipetrain.plan.costs_pipetrain import Candidate
    >>> loads = [StageLoad(compute_s=3.0, forward_s=1.0, parameter_bytes=0.0,
    ...                    activation_bytes=0.0, input_bytes=0.0, output_bytes=0.0,
    ...                    is_first=j == 0, is_last=j == 1) for j in range(2)]
    >>> simulate_step(loads, [1, 1], Candidate(schedule="gpipe", num_microbatches=2),
    ...               bandwidth=1e9).makespan
    9.0
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from pipetrain.plan.costs import StageLoad
from pipetrain.plan.costs_pipetrain import Candidate, recomputed_forwards, stage_mode
from pipetrain.schedule import (
    Costs,
    Op,
    Schedule,
    SimulationResult,
    add_fsdp_actions,
    build_schedule,
    fsdp_policy_costs,
    simulate,
)

__all__ = [
    "link_time",
    "one_stage_step",
    "predicted_step",
    "simulate_step",
    "step_costs",
    "step_lower_bound",
    "step_schedule",
    "synchronized_end",
]



def step_schedule(candidate: Candidate, replicas: Sequence[int]) -> Schedule:
    """The validated schedule of one step of a pipeline whose stage ``j`` has
    ``replicas[j]`` replicas, as the runtime builds it (built once per layout).

    Raises:
        ValueError: the schedule cannot run these replica counts (the message says why).
    """
    return _built(candidate.schedule, candidate.num_microbatches, tuple(replicas),
                  fsdp=_sharded(candidate, replicas) and not candidate.reshard_after_forward)


def _sharded(candidate: Candidate, replicas: Sequence[int]) -> bool:
    return candidate.data_parallel == "fsdp" and max(replicas) > 1


@functools.lru_cache(maxsize=512)
def _built(name: str, num_microbatches: int, counts: tuple[int, ...], *,
           fsdp: bool = False) -> Schedule:
    schedule = build_schedule(
        name,
        num_ranks=len(counts),
        num_microbatches=num_microbatches,
        optimizer_step=True,
        reduce=True,
        replicas=counts if max(counts) > 1 else None,
    )
    return add_fsdp_actions(schedule) if fsdp else schedule


def step_lower_bound(loads: Sequence[StageLoad], replicas: Sequence[int],
                     candidate: Candidate, *, bandwidth: float) -> float:
    """A lower bound of :func:`simulate_step`'s makespan, without simulating: each rank's
    compute actions, then its stage's all-reduce and optimizer step, which wait for its
    last backward (a rank runs its actions one after the other).

    Example:
        >>> from pipetrain.plan.costs import StageLoad
        >>> load = StageLoad(compute_s=3.0, forward_s=1.0, parameter_bytes=0.0,
        ...                  activation_bytes=0.0, input_bytes=0.0, output_bytes=0.0,
        ...                  is_first=True, is_last=True, optimizer_step_s=0.5)
        >>> step_lower_bound([load], [2], Candidate(num_microbatches=4), bandwidth=1e9)
        6.5

    Raises:
        ValueError: the schedule cannot run these replica counts.
    """
    schedule = step_schedule(candidate, replicas)
    costs = step_costs(loads, replicas, candidate, bandwidth=bandwidth).per_stage(len(loads))
    duration = {Op.FORWARD: costs.forward, Op.BACKWARD: costs.backward,
                Op.BACKWARD_INPUT: costs.backward_input, Op.BACKWARD_WEIGHT: costs.backward_weight,
                Op.OPTIMIZER_STEP: costs.step, Op.REDUCE_GRAD: costs.reduce}
    bound = 0.0
    for actions in schedule.actions:
        busy = 0.0
        for action in actions:
            times = duration.get(action.op)
            if times is not None:
                busy += times[action.stage]
        bound = max(bound, busy)
    return bound


def step_costs(loads: Sequence[StageLoad], replicas: Sequence[int], candidate: Candidate, *,
               bandwidth: float) -> Costs:
    """Per-stage action costs of the plan (see the module docstring).

    Example:
        >>> from pipetrain.plan.costs import StageLoad
        >>> load = StageLoad(compute_s=3.0, forward_s=1.0, backward_input_s=1.5,
        ...                  backward_weight_s=1.0, parameter_bytes=0.0, activation_bytes=0.0,
        ...                  input_bytes=0.0, output_bytes=0.0, is_first=True, is_last=True,
        ...                  gradient_bytes=1e9)
        >>> c = step_costs([load], [2], Candidate(num_microbatches=4, checkpoint="always"),
        ...                bandwidth=1e9)
        >>> c.backward, c.backward_input, c.reduce  # recompute 1 s, all-reduce of 1 GB
        ((3.0,), (2.5,), (1.0,))
    """
    forward, backward, inputs, weights, latency, reduce, step, gather = ([] for _ in range(8))
    sharded = _sharded(candidate, replicas)
    for j, (load, r) in enumerate(zip(loads, replicas)):
        per_replica = -(-candidate.num_microbatches // r)
        share = recomputed_forwards(stage_mode(candidate, j), per_replica) / per_replica
        recompute = share * load.forward_s
        forward.append(load.forward_s)
        backward.append(max(0.0, load.compute_s - load.forward_s) + recompute)
        inputs.append(load.backward_input_s + recompute)
        weights.append(load.backward_weight_s)
        latency.append(max(load.input_bytes, load.output_bytes) / bandwidth)
        ring = (r - 1) / r / bandwidth
        reduce.append((1 if sharded else 2) * ring * load.gradient_bytes)
        gather.append(ring * load.parameter_bytes if sharded else 0.0)
        step.append(load.optimizer_step_s)
    costs = Costs(
        forward=tuple(forward),
        backward=tuple(backward),
        backward_input=tuple(inputs),
        backward_weight=tuple(weights),
        communication=tuple(latency),
        reduce=tuple(reduce),
        step=tuple(step),
        unshard=tuple(gather),
    )
    if not sharded or candidate.fsdp_policy == "gathered":
        return costs
    return fsdp_policy_costs(costs, len(loads),
                             reshard_after_forward=candidate.reshard_after_forward,
                             reduce_each_microbatch=candidate.reduce_each_microbatch)


def simulate_step(loads: Sequence[StageLoad], replicas: Sequence[int], candidate: Candidate, *,
                  bandwidth: float) -> SimulationResult:
    """One step of the plan, simulated (each stage's optimizer step after its own
    all-reduce, as the schedule says; :func:`synchronized_end` adds the runtime's wait).

    Raises:
        ValueError: the schedule cannot run these replica counts.
    """
    schedule = step_schedule(candidate, replicas)
    return simulate(schedule, step_costs(loads, replicas, candidate, bandwidth=bandwidth))


def synchronized_end(result: SimulationResult) -> float:
    """When the step ends if every rank's first optimizer step waits for all ranks to
    reach theirs: the runtime checks the global gradient norm (its default
    ``nonfinite='error'``, and clipping) with one collective over all stages before any
    stage updates its weights.

    Example:
        >>> from pipetrain.schedule import build_schedule, Costs, simulate
        >>> s = build_schedule("gpipe", num_ranks=2, num_microbatches=1, optimizer_step=True)
        >>> result = simulate(s, Costs(forward=1.0, backward=2.0, step=(1.0, 5.0)))
        >>> result.makespan, synchronized_end(result)  # stage 1's step waits for stage 0's B
        (9.0, 11.0)
    """
    steps: dict[int, list[tuple[float, float]]] = {}
    for t in result.timeline:
        if t.action.op is Op.OPTIMIZER_STEP:
            steps.setdefault(t.rank, []).append((t.start, t.end - t.start))
    if not steps:
        return result.makespan
    reached = max(min(start for start, _ in ranks) for ranks in steps.values())
    return max(result.makespan,
               reached + max(sum(d for _, d in ranks) for ranks in steps.values()))


def link_time(loads: Sequence[StageLoad], replicas: Sequence[int], candidate: Candidate, *,
              bandwidth: float) -> float:
    """The busiest link's seconds per step: a replica's micro-batches' input and output
    bytes (each way: activations one way, their gradients the other) at the bandwidth.

    Example:
        >>> from pipetrain.plan.costs import StageLoad
        >>> load = StageLoad(compute_s=0.0, parameter_bytes=0.0, activation_bytes=0.0,
        ...                  input_bytes=1e9, output_bytes=0.0, is_first=False, is_last=True)
        >>> link_time([load], [2], Candidate(num_microbatches=4), bandwidth=1e9)
        2.0
    """
    return max(-(-candidate.num_microbatches // r) * (load.input_bytes + load.output_bytes)
               / bandwidth for load, r in zip(loads, replicas))


def predicted_step(loads: Sequence[StageLoad], replicas: Sequence[int], candidate: Candidate,
                   *, bandwidth: float) -> float:
    """The predicted time per step: the simulated step with its optimizer steps
    synchronized (:func:`synchronized_end`), or the busiest link's time if longer.

    Raises:
        ValueError: the schedule cannot run these replica counts.
    """
    result = simulate_step(loads, replicas, candidate, bandwidth=bandwidth)
    return max(synchronized_end(result), link_time(loads, replicas, candidate, bandwidth=bandwidth))


def one_stage_step(load: StageLoad, replicas: int, candidate: Candidate, *,
                   bandwidth: float) -> float:
    """:func:`predicted_step` of a one-stage plan (data parallelism), without building its
    schedule (whose size grows with the square of the replicas): the busiest replica runs
    its micro-batches one after the other, then the all-reduce and the optimizer step.

    Example:
        >>> from pipetrain.plan.costs import StageLoad
        >>> load = StageLoad(compute_s=3.0, forward_s=1.0, parameter_bytes=0.0,
        ...                  activation_bytes=0.0, input_bytes=0.0, output_bytes=0.0,
        ...                  is_first=True, is_last=True, optimizer_step_s=0.5)
        >>> one_stage_step(load, 2, Candidate(num_microbatches=4), bandwidth=1e9)
        6.5
        >>> one_stage_step(load, 100_000, Candidate(num_microbatches=100_000), bandwidth=1e9)
        3.5
    """
    costs = step_costs([load], [replicas], candidate, bandwidth=bandwidth).per_stage(1)
    per_replica = -(-candidate.num_microbatches // replicas)
    if any(a.op is Op.BACKWARD_INPUT for a in _built(candidate.schedule, 2, (1,)).actions[0]):
        each = costs.forward[0] + costs.backward_input[0] + costs.backward_weight[0]
    else:
        each = costs.forward[0] + costs.backward[0]
    collectives = costs.unshard[0] + costs.reduce[0] if replicas > 1 else 0.0
    busy = per_replica * each + collectives + costs.step[0]
    return max(busy, link_time([load], [replicas], candidate, bandwidth=bandwidth))
