"""Case ``schedules``' simulator side: every schedule played with per-layer costs measured here.

Pure Python (no torch): the costs come in as :class:`ModelCosts` (what the profiler
measured for each layer on one micro-batch), are balanced into the schedule's stages
(:func:`stage_balance`: the min-max contiguous cut of forward + backward), summed per
stage, and the schedule is simulated (:func:`simulate_schedule`) on ``K`` ranks with ``M``
micro-batches. A synchronous schedule is one step with its optimizer steps; an
asynchronous one (``pipedream``, ``2bw``) is a step in its steady state, as
``Pipeline.train_step`` runs it (:func:`~pipetrain.schedule.steady_state.step_window`: the
pipeline already full, every rank ending the step together). Activation memory is
counted per rank from the action lists (:func:`peak_activation_bytes`): a micro-batch's
stage holds its activations from its ``F`` to its last backward (``B``, or ``W`` when
split), as the simulator's ``peak_activations`` counts them.

Example:
    >>> uniform = ModelCosts.uniform(8, forward=1.0, backward=2.0, activation_bytes=10)
    >>> result = simulate_schedule("1f1b", uniform, num_ranks=4, num_microbatches=8)
    >>> round(result.bubble, 4) == round(analytic_bubble(4, 8), 4), result.peak_held
    (True, 4)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pipetrain.plan.contiguous import solve
from pipetrain.schedule import (
    ASYNC_SCHEDULES,
    TRAINING_SCHEDULES,
    AsyncStream,
    Costs,
    Schedule,
    StageBytes,
    activation_peaks,
    build_schedule,
    default_stages_per_rank,
    simulate,
    steady_state,
    versions_held,
)
from pipetrain.schedule.steady_state import step_window

__all__ = ["SCHEDULES", "ModelCosts", "Simulated", "analytic_bubble", "peak_activation_bytes",
           "simulate_schedule", "stage_balance", "stage_costs"]

SCHEDULES: tuple[str, ...] = TRAINING_SCHEDULES
"""Every training schedule pipetrain has, in its registry's order."""

_LONG_RUN = 8
"""Steps of the asynchronous run whose middle gives its free-streaming rate and whose
action lists give its activations and weight versions held."""


@dataclass(frozen=True, kw_only=True)
class ModelCosts:
    """Per layer, on one micro-batch: seconds of the forward, the whole backward, its
    input and weight halves (as the zero-bubble schedules split it), the optimizer step,
    the bytes of activations its forward saves for its backward, and the temporary bytes
    its whole backward and its input-gradient pass need (empty: not measured).

    Example:
        >>> ModelCosts.uniform(2, forward=1.0, backward=2.0).backward_input
        (1.0, 1.0)
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    step: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    workspace_bytes: tuple[int, ...] = ()
    input_workspace_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        lengths = {name: len(value) for name, value in asdict(self).items()
                   if value or name not in ("workspace_bytes", "input_workspace_bytes")}
        if len(set(lengths.values())) != 1 or not self.forward:
            raise ValueError(f"ModelCosts needs one value per layer in every field (at least "
                             f"one layer), got lengths {lengths}")

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.forward)

    @classmethod
    def uniform(cls, num_layers: int, *, forward: float, backward: float, step: float = 0.0,
                activation_bytes: int = 0) -> ModelCosts:
        """``num_layers`` equal layers (the backward's halves equal).

        Example:
            >>> ModelCosts.uniform(3, forward=1.0, backward=2.0).num_layers
            3
        """
        def same(value: Any) -> tuple[Any, ...]:
            return (value,) * num_layers

        return cls(forward=same(forward), backward=same(backward),
                   backward_input=same(backward / 2), backward_weight=same(backward / 2),
                   step=same(step), activation_bytes=same(activation_bytes))

    @classmethod
    def from_dict(cls, data: dict[str, Sequence[Any]]) -> ModelCosts:
        """From :func:`dataclasses.asdict`'s data (after a JSON round trip).

        Example:
            >>> costs = ModelCosts.uniform(2, forward=1.0, backward=2.0)
            >>> ModelCosts.from_dict(asdict(costs)) == costs
            True
        """
        return cls(**{name: tuple(values) for name, values in data.items()})


@dataclass(frozen=True, kw_only=True)
class Simulated:
    """A schedule simulated on ``num_ranks`` ranks: its step (seconds; an asynchronous
    schedule's step in the steady state), the idle share of all ranks' time, the most
    (stage, micro-batch) activations a rank holds and their bytes, the most weight
    versions a stage keeps, and the cut (layers per stage).
    ``stream_s_per_microbatch``: an asynchronous schedule streaming without step ends
    (``None`` for the synchronous ones)."""

    schedule: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    makespan_s: float
    bubble: float
    peak_held: int
    peak_bytes: int
    weight_versions: int
    balance: tuple[int, ...]
    stream_s_per_microbatch: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return {**asdict(self), "balance": list(self.balance)}


def analytic_bubble(num_ranks: int, num_microbatches: int) -> float:
    """GPipe's and 1F1B's bubble with equal stages and no optimizer step: (K-1)/(M+K-1).

    Example:
        >>> analytic_bubble(4, 8)
        0.2727272727272727
    """
    return (num_ranks - 1) / (num_microbatches + num_ranks - 1)


def stage_balance(costs: ModelCosts, num_stages: int) -> list[int]:
    """Layers per stage: the contiguous cut whose largest forward + backward is least.

    Raises:
        ValueError: fewer layers than stages (the message says how many are needed).

    Example:
        >>> stage_balance(ModelCosts.uniform(8, forward=1.0, backward=2.0), 4)
        [2, 2, 2, 2]
    """
    if costs.num_layers < num_stages:
        raise ValueError(f"{num_stages} stages need at least {num_stages} layers, the model "
                         f"has {costs.num_layers}; fix: a deeper model or fewer stages")
    return solve([f + b for f, b in zip(costs.forward, costs.backward)], num_stages)


def stage_costs(costs: ModelCosts, balance: Sequence[int]) -> tuple[Costs, tuple[int, ...]]:
    """The simulator's per-stage costs for a cut (sums of its layers'; no communication
    cost), and each stage's activation bytes per micro-batch.

    Example:
        >>> c, held = stage_costs(ModelCosts.uniform(4, forward=1.0, backward=2.0,
        ...                                          activation_bytes=3), [1, 3])
        >>> c.forward, c.backward_weight, held
        ((1.0, 3.0), (1.0, 3.0), (3, 9))
    """
    bounds = [sum(balance[:j]) for j in range(len(balance) + 1)]

    def summed(values: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(sum(values[bounds[j]:bounds[j + 1]]) for j in range(len(balance)))

    return (Costs(forward=summed(costs.forward), backward=summed(costs.backward),
                  backward_input=summed(costs.backward_input),
                  backward_weight=summed(costs.backward_weight), step=summed(costs.step)),
            summed(costs.activation_bytes))


def peak_activation_bytes(schedule: Schedule, stage_bytes: Sequence[int]) -> tuple[int, ...]:
    """Per rank, the most activation bytes held at once: ``stage_bytes[j]`` from each
    ``F`` of stage ``j`` to its ``B`` (or ``W``, when the backward is split).

    Example:
        >>> from pipetrain.schedule import gpipe
        >>> peak_activation_bytes(gpipe(2, 3), [5, 7])
        (15, 21)
    """
    peaks = activation_peaks(schedule, [StageBytes(saved=b) for b in stage_bytes]).per_rank
    return tuple(int(p) for p in peaks)


def _held(schedule: Schedule) -> int:
    """The most (stage, micro-batch) activations a rank holds at once."""
    return max(peak_activation_bytes(schedule, [1] * schedule.num_stages))


def simulate_schedule(name: str, costs: ModelCosts, *, num_ranks: int,
                      num_microbatches: int) -> Simulated:
    """Simulate schedule ``name`` on ``num_ranks`` ranks (its default stages per rank),
    ``num_microbatches`` micro-batches per step, with ``costs`` cut by :func:`stage_balance`.

    Example (a stage's micro-batch costs 6; PipeDream's steady step has no fill or
    drain, 1F1B's step has both, and PipeDream keeps up to K weight versions):
        >>> uniform = ModelCosts.uniform(4, forward=1.0, backward=2.0)
        >>> r = simulate_schedule("pipedream", uniform, num_ranks=2, num_microbatches=4)
        >>> r.makespan_s, r.weight_versions, r.stream_s_per_microbatch
        (26.0, 2, 6.0)
        >>> simulate_schedule("1f1b", uniform, num_ranks=2, num_microbatches=4).makespan_s
        30.0
    """
    virtual = default_stages_per_rank(name)
    balance = stage_balance(costs, num_ranks * virtual)
    per_stage, stage_bytes = stage_costs(costs, balance)
    common: dict[str, Any] = {"num_ranks": num_ranks, "num_microbatches": num_microbatches,
                              "stages_per_rank": virtual, "communication": False}
    stream: float | None = None
    versions = 1
    if name in ASYNC_SCHEDULES:
        step = step_window(AsyncStream(name, [1] * num_ranks), num_microbatches)
        long_run = build_schedule(name, **common, num_steps=_LONG_RUN)
        held = long_run
        stream = steady_state(long_run, simulate(long_run, per_stage).timeline).steady
        versions = max(versions_held(long_run).values())
    else:
        step = build_schedule(name, **common, optimizer_step=True)
        held = step
    result = simulate(step, per_stage)
    return Simulated(schedule=name, num_ranks=num_ranks, num_stages=len(balance),
                     num_microbatches=num_microbatches, makespan_s=result.makespan,
                     bubble=result.bubble_fraction, peak_held=_held(held),
                     peak_bytes=max(peak_activation_bytes(held, stage_bytes)),
                     weight_versions=versions, balance=tuple(balance),
                     stream_s_per_microbatch=stream)
