"""The cost-model interface: what the planner asks a model about a candidate stage.

The planner (:mod:`pipetrain.plan.optimizer`) searches over stages, replica counts and
cuts; a *cost model* says what one candidate stage costs. It is a
:class:`CostModel`: three methods over a :class:`StageLoad` (what the stage holds and
what crosses its cuts) at one :class:`LevelContext` (the topology level it is placed at).

- ``stage_time(load, replicas=r, level=...)``: the stage's time per step with ``r``
  replicas. The planner minimizes the largest stage time (the pipeline's bottleneck),
  which is exactly what a decomposable model such as PipeDream's predicts as the time
  per step. Any function of the stage, its replicas, whether it is first or last, and the
  level's bandwidth is allowed; it need not be monotone in ``r``.
- ``stage_memory(load, replicas=r, workers_from_stage=w)``: bytes per worker of the stage
  when ``w`` workers run this stage and the ones after it (how many micro-batches are in
  flight depends on that). **Contract**: it must not decrease when ``w`` grows with ``r``
  fixed (more workers downstream never means less to keep). The planner's exactness under
  a memory limit relies on this and nothing else.
- ``min_replicas(row, level=..., time_limit=T, max_replicas=R, at_least=1,
  indices=None)``: for a :class:`StageRow` (candidate stages that start at the same cut;
  only the entries ``indices``, if given), the smallest ``r`` in ``at_least..R`` with
  ``stage_time <= T`` for each, 0 where there is none. It is the
  planner's inner loop, so a model implements it fast (PipeDream's solves a quadratic); :func:`scan_min_replicas`
  derives it from ``stage_time`` for a model that has nothing better.
- ``memory_replicas(row, memory_limit=L, workers_after=[d, ...], max_replicas=R)``: per
  entry, the smallest ``r <= R`` whose ``stage_memory`` with ``d + r`` workers from the
  stage on fits ``L`` (0: none); :func:`scan_memory_replicas` derives it.
- ``replicas_monotone``: True when, from 2 replicas on, one more replica never makes a
  stage slower nor need more memory per worker (for the same workers after it). Then
  plans on *exactly* the given number of workers are found by one extra probe; otherwise
  the planner may fall back to the plain program of :mod:`pipetrain.plan.exact_dp`.
- ``max_replicas`` (optional): the most replicas a stage can run on at all (every
  ``stage_time`` above it is unrunnable); the programs over worker counts then try no
  more (:func:`replica_cap`). A model without it has no such limit.

What the search minimizes is the bottleneck stage time, which is exactly PipeDream's
time per step. The schedule-aware ``pipetrain`` cost model
(:mod:`pipetrain.plan.costs_pipetrain`) answers the same questions for one schedule,
micro-batch count and checkpoint mode; its planner (:mod:`pipetrain.plan.schedule_choice`)
runs the searches per candidate (and per depth, :mod:`pipetrain.plan.depths`) and scores
the plans they find by simulating their step.

Example:
    >>> load = StageLoad(compute_s=1.0, parameter_bytes=0.0, activation_bytes=0.0,
    ...                  input_bytes=0.0, output_bytes=0.0, is_first=True, is_last=True)
    >>> row = StageRow.of([load])
    >>> len(row), row.load(0) == load
    (1, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "CostModel",
    "LevelContext",
    "StageLoad",
    "StageRow",
    "replica_cap",
    "scan_memory_replicas",
    "scan_min_replicas",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class LevelContext:
    """Where a stage is placed: a topology level's bandwidth and unit size.

    Example:
        >>> LevelContext(bandwidth=1e9).workers_per_unit
        1
    """

    bandwidth: float
    """Bytes per second between the units of this level."""
    workers_per_unit: int = 1
    """Workers inside one unit of this level: 1 at the innermost level; above it, the
    count of the level below (PipeDream divides the first stage's all-reduce by it)."""
    level_index: int = 0
    """0 for the innermost level."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageLoad:
    """What one candidate stage holds and what crosses its cuts, for one step.

    At the innermost level ``compute_s`` is the sum of the nodes' forward and backward
    seconds; at an outer level it is the predicted step time of the stage's own inner
    pipeline (one unit, e.g. one server, running it).

    Example:
        >>> StageLoad(compute_s=0.5, parameter_bytes=4e6, activation_bytes=1e6,
        ...           input_bytes=2e6, output_bytes=0.0, is_first=False, is_last=True).is_last
        True
    """

    compute_s: float
    parameter_bytes: float
    activation_bytes: float
    """Sum of the nodes' output bytes (PipeDream's ``activation_size`` of a stage)."""
    input_bytes: float
    """Bytes of activations crossing the cut before the stage (0 before the first node)."""
    output_bytes: float
    """Bytes of activations crossing the cut after the stage (0 after the last node)."""
    is_first: bool
    """The stage is the first of the pipeline planned at this level."""
    is_last: bool
    """The stage ends the model."""
    weight_memory_bytes: float = 0.0
    """Parameters, gradients and optimizer state (from the profile; PipeDream's profiles
    only have parameters)."""
    saved_bytes: float = 0.0
    """Activations the nodes keep for their backward (0: not measured)."""
    forward_s: float = 0.0
    """The forward part of ``compute_s`` (models that only need the sum leave it 0)."""
    backward_input_s: float = 0.0
    """The input-gradient half of a split backward (zero-bubble schedules' ``I``)."""
    backward_weight_s: float = 0.0
    """The weight-gradient half of a split backward (``W``); the whole backward (as one
    pass, ``compute_s - forward_s``) may take less than the two halves."""
    gradient_bytes: float = 0.0
    """Bytes of the parameters' gradients (what a replicated stage all-reduces)."""
    optimizer_step_s: float = 0.0
    """Seconds of one optimizer step over the stage's parameters (0: not measured)."""
    workspace_bytes: float = 0.0
    """The temporary memory of the stage's whole backward: its largest node's (0: not
    measured)."""
    input_workspace_bytes: float = 0.0
    """Likewise for the input-gradient pass of a split backward."""
    layer_saved_bytes: float = 0.0
    """The largest node's saved activations, what a ``per_layer`` backward rebuilds at once
    (0: not measured)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class StageRow:
    """Candidate stages that start at the same cut, as columns (one entry per end).

    A row is probed many times with different time limits; ``cache`` is where a model
    keeps what it derives from the columns once (keyed by its name and the level).

    Example:
        >>> row = StageRow(compute_s=[1.0, 2.0], parameter_bytes=[0.0, 0.0],
        ...                activation_bytes=[0.0, 0.0], output_bytes=[5.0, 0.0],
        ...                is_last=[False, True], input_bytes=0.0, is_first=True)
        >>> len(row), row.load(1).is_last
        (2, True)
    """

    compute_s: Sequence[float]
    parameter_bytes: Sequence[float]
    activation_bytes: Sequence[float]
    output_bytes: Sequence[float]
    is_last: Sequence[bool]
    input_bytes: float
    is_first: bool
    weight_memory_bytes: Sequence[float] = ()
    """Empty: zero for every entry."""
    saved_bytes: Sequence[float] = ()
    """Empty: zero for every entry."""
    forward_s: Sequence[float] = ()
    """Empty: zero for every entry (and likewise the columns below)."""
    backward_input_s: Sequence[float] = ()
    backward_weight_s: Sequence[float] = ()
    gradient_bytes: Sequence[float] = ()
    optimizer_step_s: Sequence[float] = ()
    workspace_bytes: Sequence[float] = ()
    input_workspace_bytes: Sequence[float] = ()
    layer_saved_bytes: Sequence[float] = ()
    cache: dict[object, object] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.compute_s)

    def load(self, k: int) -> StageLoad:
        """The ``k``-th candidate as a :class:`StageLoad`."""
        return StageLoad(
            compute_s=self.compute_s[k],
            parameter_bytes=self.parameter_bytes[k],
            activation_bytes=self.activation_bytes[k],
            input_bytes=self.input_bytes,
            output_bytes=self.output_bytes[k],
            is_first=self.is_first,
            is_last=self.is_last[k],
            weight_memory_bytes=self.weight_memory_bytes[k] if self.weight_memory_bytes else 0.0,
            saved_bytes=self.saved_bytes[k] if self.saved_bytes else 0.0,
            forward_s=self.forward_s[k] if self.forward_s else 0.0,
            backward_input_s=self.backward_input_s[k] if self.backward_input_s else 0.0,
            backward_weight_s=self.backward_weight_s[k] if self.backward_weight_s else 0.0,
            gradient_bytes=self.gradient_bytes[k] if self.gradient_bytes else 0.0,
            optimizer_step_s=self.optimizer_step_s[k] if self.optimizer_step_s else 0.0,
            workspace_bytes=self.workspace_bytes[k] if self.workspace_bytes else 0.0,
            input_workspace_bytes=(self.input_workspace_bytes[k] if self.input_workspace_bytes
                                   else 0.0),
            layer_saved_bytes=self.layer_saved_bytes[k] if self.layer_saved_bytes else 0.0,
        )

    @staticmethod
    def of(loads: Sequence[StageLoad]) -> StageRow:
        """A row from loads that share ``input_bytes`` and ``is_first``."""
        if not loads:
            raise ValueError("StageRow.of needs at least one load")
        first = loads[0]
        if any(x.input_bytes != first.input_bytes or x.is_first != first.is_first for x in loads):
            raise ValueError("the loads of a row must share input_bytes and is_first")
        return StageRow(
            compute_s=[x.compute_s for x in loads],
            parameter_bytes=[x.parameter_bytes for x in loads],
            activation_bytes=[x.activation_bytes for x in loads],
            output_bytes=[x.output_bytes for x in loads],
            is_last=[x.is_last for x in loads],
            input_bytes=first.input_bytes,
            is_first=first.is_first,
            weight_memory_bytes=[x.weight_memory_bytes for x in loads],
            saved_bytes=[x.saved_bytes for x in loads],
            forward_s=[x.forward_s for x in loads],
            backward_input_s=[x.backward_input_s for x in loads],
            backward_weight_s=[x.backward_weight_s for x in loads],
            gradient_bytes=[x.gradient_bytes for x in loads],
            optimizer_step_s=[x.optimizer_step_s for x in loads],
            workspace_bytes=[x.workspace_bytes for x in loads],
            input_workspace_bytes=[x.input_workspace_bytes for x in loads],
            layer_saved_bytes=[x.layer_saved_bytes for x in loads],
        )


class CostModel(Protocol):
    """What the planner needs from a cost model (see the module docstring).

    Example:
        >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
        >>> model: CostModel = PipeDreamCostModel()
        >>> model.name
        'pipedream'
    """

    @property
    def name(self) -> str:
        """The name ``--cost-model`` selects it by."""
        ...

    @property
    def replicas_monotone(self) -> bool:
        """See the module docstring."""
        ...

    def stage_time(self, load: StageLoad, *, replicas: int, level: LevelContext) -> float:
        """Seconds per step of the stage with ``replicas`` replicas."""
        ...

    def stage_memory(self, load: StageLoad, *, replicas: int, workers_from_stage: int) -> float:
        """Bytes per worker; must not decrease as ``workers_from_stage`` grows."""
        ...

    def min_replicas(
        self,
        row: StageRow,
        *,
        level: LevelContext,
        time_limit: float,
        max_replicas: int,
        at_least: int = 1,
        indices: Sequence[int] | None = None,
    ) -> list[int]:
        """Per entry of ``row`` (or per entry in ``indices``), the smallest ``r`` in
        ``at_least..max_replicas`` with ``stage_time <= time_limit``; 0 where there is
        none."""
        ...

    def memory_replicas(
        self,
        row: StageRow,
        *,
        memory_limit: float,
        workers_after: Sequence[int],
        max_replicas: int,
        indices: Sequence[int] | None = None,
    ) -> list[int]:
        """Per entry of ``row`` (or of ``indices``, which ``workers_after`` then follows),
        the smallest ``r`` in ``1..max_replicas`` whose memory per worker with
        ``workers_after[k] + r`` workers from the stage on is at most ``memory_limit``;
        0 where there is none."""
        ...


def scan_min_replicas(
    model: CostModel,
    row: StageRow,
    *,
    level: LevelContext,
    time_limit: float,
    max_replicas: int,
    at_least: int = 1,
    indices: Sequence[int] | None = None,
) -> list[int]:
    """:meth:`CostModel.min_replicas` by trying ``r = 1, 2, ...`` with ``stage_time``.

    Correct for any model, and slow (``O(max_replicas)`` calls per entry); a model with a
    closed form should implement ``min_replicas`` itself.

    Example:
        >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
        >>> load = StageLoad(compute_s=3.0, parameter_bytes=0.0, activation_bytes=0.0,
        ...                  input_bytes=0.0, output_bytes=0.0, is_first=True, is_last=True)
        >>> scan_min_replicas(PipeDreamCostModel(), StageRow.of([load]),
        ...                   level=LevelContext(bandwidth=1e9), time_limit=1.0, max_replicas=8)
        [3]
    """
    out = []
    for k in range(len(row)) if indices is None else indices:
        load = row.load(k)
        found = 0
        for r in range(at_least, max_replicas + 1):
            if model.stage_time(load, replicas=r, level=level) <= time_limit:
                found = r
                break
        out.append(found)
    return out


def scan_memory_replicas(
    model: CostModel,
    row: StageRow,
    *,
    memory_limit: float,
    workers_after: Sequence[int],
    max_replicas: int,
    indices: Sequence[int] | None = None,
) -> list[int]:
    """:meth:`CostModel.memory_replicas` by trying ``r = 1, 2, ...`` with ``stage_memory``.

    Example:
        >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
        >>> load = StageLoad(compute_s=1.0, parameter_bytes=1.0, activation_bytes=1.0,
        ...                  input_bytes=0.0, output_bytes=0.0, is_first=True, is_last=True)
        >>> scan_memory_replicas(PipeDreamCostModel(), StageRow.of([load]), memory_limit=4.0,
        ...                      workers_after=[3], max_replicas=8)  # 2 bytes x ceil(6 / 3)
        [3]
    """
    out = []
    for k, after in zip(range(len(row)) if indices is None else indices, workers_after):
        load = row.load(k)
        found = 0
        for r in range(1, max_replicas + 1):
            used = model.stage_memory(load, replicas=r, workers_from_stage=after + r)
            if used <= memory_limit:
                found = r
                break
        out.append(found)
    return out


def replica_cap(model: CostModel) -> int | None:
    """The model's optional ``max_replicas`` (see the module docstring); None: no limit.

    Example:
        >>> from pipetrain.plan.costs_pipedream import PipeDreamCostModel
        >>> from pipetrain.plan.costs_pipetrain import Candidate, PipetrainCostModel
        >>> replica_cap(PipeDreamCostModel()), replica_cap(PipetrainCostModel(Candidate(num_microbatches=8)))
        (None, 8)
    """
    cap = getattr(model, "max_replicas", None)
    return cap if isinstance(cap, int) and not isinstance(cap, bool) else None
