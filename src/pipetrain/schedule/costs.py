"""Per-action costs for the simulator: how long each kind of action takes, per stage.

:func:`model_costs` prices the stages of a schedule by the layers they hold, so that
schedules of the same ranks compare on the same model: a stage of a schedule with two
stages per rank holds half a rank's layers and costs half as much.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import TypeAlias

from pipetrain.counts import count_of

__all__ = ["LAYER_COSTS", "CostValue", "Costs", "StageCosts", "even_layers", "model_costs"]

CostValue: TypeAlias = float | tuple[float, ...]
"""One cost for every stage, or a tuple with one cost per stage."""


@dataclass(frozen=True, kw_only=True)
class Costs:
    """How long each action takes, in any time unit; a float, or one value per stage.

    ``backward`` defaults to twice ``forward``; ``backward_input`` and ``backward_weight``
    (the two halves of a split backward, ``I`` and ``W``) default to half of ``backward``.
    ``communication`` is the latency of one message (the receiver waits until the
    message arrives); ``send`` is the time an explicit send (``SF``/``SB``) keeps the
    sending rank busy (packing and posting the message; 0: sends are free). ``reduce`` is the duration of one
    stage's gradient all-reduce (it runs in the background; the stage's ``STEP`` waits
    for it); ``step`` is the optimizer step; ``unshard`` is the duration of an FSDP
    stage's parameter all-gather (``UNSHARD``: in the background, the stage's next compute
    action waits for it).

    Example:
        >>> costs = Costs(forward=1, backward_input=1.5)
        >>> c = costs.per_stage(2)
        >>> c.backward, c.backward_input, c.backward_weight
        ((2.0, 2.0), (1.5, 1.5), (1.0, 1.0))
        >>> Costs.parse("forward=1:1:2,communication=0.1").forward
        (1.0, 1.0, 2.0)
    """

    forward: CostValue = 1.0
    backward: CostValue | None = None
    backward_input: CostValue | None = None
    backward_weight: CostValue | None = None
    communication: CostValue = 0.0
    send: CostValue = 0.0
    reduce: CostValue = 0.0
    step: CostValue = 0.0
    unshard: CostValue = 0.0

    def __post_init__(self) -> None:
        problems = []
        for name in _NAMES:
            value = getattr(self, name)
            if value is None:
                continue
            values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
            if not values:
                problems.append(f"{name}=() is empty; give one value per stage")
                continue
            bad = [
                v
                for v in values
                if isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
            ]
            if bad:
                problems.append(
                    f"{name}={value!r}: costs must be finite numbers >= 0, got {bad[0]!r}"
                )
                continue
            floats = tuple(float(v) for v in values)
            object.__setattr__(
                self, name, floats if isinstance(value, (tuple, list)) else floats[0]
            )
        lengths = {
            name: len(value) for name in _NAMES if isinstance(value := getattr(self, name), tuple)
        }
        if not problems and len(set(lengths.values())) > 1:
            problems.append(f"per-stage costs have different lengths: {lengths}")
        if problems:
            raise ValueError("invalid costs: " + "; ".join(problems))

    def per_stage(self, num_stages: int) -> StageCosts:
        """Every cost resolved (defaults derived) to one value per stage.

        Raises:
            ValueError: a per-stage tuple does not have ``num_stages`` values.
        """
        problems = [
            f"{name} has {count_of(len(value), 'value')} but the schedule has "
            f"{count_of(num_stages, 'stage')}"
            for name in _NAMES
            if isinstance(value := getattr(self, name), tuple) and len(value) != num_stages
        ]
        if problems:
            raise ValueError("costs do not fit the schedule: " + "; ".join(problems))

        def expand(value: CostValue) -> tuple[float, ...]:
            return value if isinstance(value, tuple) else (value,) * num_stages

        forward = expand(self.forward)
        backward = tuple(2 * f for f in forward) if self.backward is None else expand(self.backward)
        half = tuple(b / 2 for b in backward)
        return StageCosts(
            forward=forward,
            backward=backward,
            backward_input=half if self.backward_input is None else expand(self.backward_input),
            backward_weight=half if self.backward_weight is None else expand(self.backward_weight),
            communication=expand(self.communication),
            send=expand(self.send),
            reduce=expand(self.reduce),
            step=expand(self.step),
            unshard=expand(self.unshard),
        )

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Read ``name=value`` pairs separated by commas; ``a:b:c`` gives per-stage values.

        Example:
            >>> Costs.parse("forward=1,backward=3").backward
            3.0
            >>> Costs.parse("fwd=1")
            Traceback (most recent call last):
            ...
            ValueError: unknown cost 'fwd' in 'fwd=1'; known: forward, backward, backward_input, backward_weight, communication, send, reduce, step, unshard

        Raises:
            ValueError: an unknown name, a repeated name, or a value that is not a number.
        """
        values: dict[str, CostValue] = {}
        problems = []
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            name, sep, value_text = (s.strip() for s in item.partition("="))
            if not sep or not value_text:
                problems.append(f"{item!r} is not name=value (e.g. 'forward=1')")
            elif name not in _NAMES:
                problems.append(f"unknown cost {name!r} in {item!r}; known: {', '.join(_NAMES)}")
            elif name in values:
                problems.append(f"cost {name!r} given twice")
            else:
                try:
                    numbers = tuple(float(v) for v in value_text.split(":"))
                except ValueError:
                    problems.append(f"cost {name}={value_text!r} is not a number (or a:b:c)")
                    continue
                values[name] = numbers if ":" in value_text else numbers[0]
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**values)

    def to_dict(self) -> dict[str, float | list[float] | None]:
        """The costs as given (``None`` where derived), for JSON."""
        return {
            name: list(value) if isinstance(value := getattr(self, name), tuple) else value
            for name in _NAMES
        }


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Costs resolved to one value per stage (see :meth:`Costs.per_stage`).

    Example:
        >>> Costs().per_stage(2).forward
        (1.0, 1.0)
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    communication: tuple[float, ...]
    send: tuple[float, ...]
    reduce: tuple[float, ...]
    step: tuple[float, ...]
    unshard: tuple[float, ...]


_NAMES = tuple(f.name for f in fields(Costs))

LAYER_COSTS = ("forward", "backward", "backward_input", "backward_weight", "reduce", "step",
               "unshard")
"""The costs that grow with a stage's layers (its compute, its gradients' all-reduce, its
parameters' all-gather and its optimizer step); a message's ``communication`` and ``send``
do not."""


def even_layers(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """``num_layers`` layers cut into ``num_stages`` contiguous stages as evenly as whole
    layers allow (the first stages take the extra ones).

    Raises:
        ValueError: fewer layers than stages.

    Example:
        >>> even_layers(8, 4), even_layers(6, 4)
        ((2, 2, 2, 2), (2, 2, 1, 1))
    """
    if num_layers < num_stages:
        raise ValueError(f"{count_of(num_layers, 'layer')} cannot fill "
                         f"{count_of(num_stages, 'stage')} (each needs one); fix: at least "
                         f"{count_of(num_stages, 'layer')}")
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (j < extra) for j in range(num_stages))


def model_costs(costs: Costs, *, num_ranks: int, stage_layers: tuple[int, ...]) -> Costs:
    """``costs`` of one rank's share of a model (``1 / num_ranks`` of it: what a stage
    costs when each rank holds one) turned into per-stage costs for stages that hold
    ``stage_layers`` of its equal layers: each of :data:`LAYER_COSTS` given as one
    number is scaled by ``stage_layers[j] * num_ranks / sum(stage_layers)``; a cost given
    per stage, and the message costs, are kept as they are.

    Raises:
        ValueError: a cost given per stage does not have one value per stage.

    Example:
        >>> scaled = model_costs(Costs(forward=1.0), num_ranks=2, stage_layers=(1, 1, 1, 1))
        >>> scaled.forward, scaled.per_stage(4).backward  # a V schedule's stage: half a rank
        ((0.5, 0.5, 0.5, 0.5), (1.0, 1.0, 1.0, 1.0))
        >>> model_costs(Costs(forward=1.0), num_ranks=2, stage_layers=(2, 1)).forward
        (1.3333333333333333, 0.6666666666666666)
    """
    costs.per_stage(len(stage_layers))  # per-stage costs fit the stages, or a ValueError
    num_layers = sum(stage_layers)
    shares = tuple(layers * num_ranks / num_layers for layers in stage_layers)
    scaled = {}
    for name in LAYER_COSTS:
        value = getattr(costs, name)
        if isinstance(value, float):
            scaled[name] = tuple(value * share for share in shares)
    return dataclasses.replace(costs, **scaled)
