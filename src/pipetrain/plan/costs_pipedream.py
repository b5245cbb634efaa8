"""PipeDream's cost model, exactly as its optimizer (``optimizer_graph_hierarchical.py``) computes it.

For a stage with compute ``C`` (forward plus backward seconds), parameter bytes ``P`` and
``r`` replicas at a level with bandwidth ``B`` (bytes/s), the stage's time per minibatch
is the largest of

- compute and all-reduce: ``(C + 4 (r - 1) P / (B r)) / r`` (for the first stage of a
  pipeline at an outer level, PipeDream divides the all-reduce term by the number of
  workers inside one unit, i.e. the level below's count; later stages are not divided,
  as in its code);
- for every stage but the first, receiving its input: ``2 O_in / (B r)``;
- for every stage but the first and the last, sending its output: ``2 O_out / (B r)``;

where ``O`` is the bytes of activations crossing the cut (PipeDream's
``output_activation_size``, its ``--activation_compression_ratio 1`` setting). The time
per step is the largest stage time. At an outer level ``C`` is the time of the stage's
inner pipeline on one unit (see :mod:`pipetrain.plan.hierarchy`).

Memory per worker: the stage's activations (its nodes' output bytes) and parameters,
once per minibatch in flight at the stage, ``ceil(w / r)`` for ``w`` workers from this
stage to the end of the pipeline (PipeDream's "NOAM" for the input stage). PipeDream's
code counts ``w`` without the stage's own workers, so that a last stage or pure data
parallelism would need no memory; pipetrain counts them.

Example:
    >>> from pipetrain.plan.costs import LevelContext, StageLoad
    >>> load = StageLoad(compute_s=0.3, parameter_bytes=1e8, activation_bytes=2e8,
    ...                  input_bytes=1e8, output_bytes=0.0, is_first=False, is_last=True)
    >>> model = PipeDreamCostModel()
    >>> round(model.stage_time(load, replicas=2, level=LevelContext(bandwidth=1e9)), 4)
    0.25
    >>> model.stage_memory(load, replicas=2, workers_from_stage=2)
    300000000.0
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipetrain.plan.costs import LevelContext, StageLoad, StageRow

__all__ = ["PipeDreamCostModel"]


def _time(
    compute: float,
    parameters: float,
    input_bytes: float,
    output_bytes: float,
    first: bool,
    last: bool,
    r: int,
    bandwidth: float,
    within: int,
) -> float:
    # The float operations in PipeDream's order, so that equal plans give equal times.
    allreduce = (4 * (r - 1) * parameters) / (bandwidth * r)
    if first:
        allreduce /= within
        return (compute + allreduce) / r
    time = max((compute + allreduce) / r, (2.0 * input_bytes) / (bandwidth * r))
    if not last:
        time = max(time, (2.0 * output_bytes) / (bandwidth * r))
    return time


class PipeDreamCostModel:
    """PipeDream's optimizer's cost model (see the module docstring).

    Example:
        >>> from pipetrain.plan.costs import LevelContext, StageRow, StageLoad
        >>> load = StageLoad(compute_s=4.0, parameter_bytes=0.0, activation_bytes=0.0,
        ...                  input_bytes=0.0, output_bytes=0.0, is_first=True, is_last=True)
        >>> PipeDreamCostModel().min_replicas(StageRow.of([load]), time_limit=1.0,
        ...     level=LevelContext(bandwidth=1e9), max_replicas=8)
        [4]
    """

    name = "pipedream"
    replicas_monotone = True
    """From 2 replicas on, more replicas never make a stage slower or need more memory
    per worker (with the workers after it fixed)."""

    def stage_time(self, load: StageLoad, *, replicas: int, level: LevelContext) -> float:
        return _time(
            load.compute_s,
            load.parameter_bytes,
            load.input_bytes,
            load.output_bytes,
            load.is_first,
            load.is_last,
            replicas,
            level.bandwidth,
            level.workers_per_unit,
        )

    def stage_memory(self, load: StageLoad, *, replicas: int, workers_from_stage: int) -> float:
        in_flight = -(-workers_from_stage // replicas)
        return (load.activation_bytes + load.parameter_bytes) * in_flight

    def memory_replicas(
        self,
        row: StageRow,
        *,
        memory_limit: float,
        workers_after: Sequence[int],
        max_replicas: int,
        indices: Sequence[int] | None = None,
    ) -> list[int]:
        # (A + P) * (1 + ceil(d / r)) <= L  <=>  r >= d / (q - 1) with q = floor(L / (A + P))
        out = []
        held_column = _held(row)
        if indices is not None:
            held_column = [held_column[k] for k in indices]
        for held, after in zip(held_column, workers_after):
            if held * (1 + after) <= memory_limit:  # one replica fits
                out.append(1 if max_replicas >= 1 else 0)
                continue
            slots = math.floor(memory_limit / held) - 1  # minibatches beyond one in flight
            if slots < 1 or held * 2 > memory_limit:
                out.append(0)
                continue
            r = max(1, -(-after // slots))
            while r > 1 and held * (1 + -(-after // (r - 1))) <= memory_limit:
                r -= 1
            while r <= max_replicas and held * (1 + -(-after // r)) > memory_limit:
                r += 1
            out.append(r if r <= max_replicas else 0)
        return out

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
        n = len(row) if indices is None else len(indices)
        if max_replicas < at_least:
            return [0] * n
        limit = time_limit
        if limit == math.inf:
            return [at_least] * n
        prepared = _prepare(row, level)
        columns = (
            prepared.one, row.compute_s, row.parameter_bytes, row.output_bytes, row.is_last,
            prepared.a, prepared.b, prepared.transfer,
        )
        if indices is not None:
            columns = tuple([column[k] for k in indices] for column in columns)  # type: ignore[assignment]
        if max_replicas == 1:
            return [1 if one <= limit else 0 for one in columns[0]]
        entries: Iterable[tuple[float, float, float, float, bool, float, float, float]]
        entries = zip(*columns)
        bandwidth, first = level.bandwidth, row.is_first
        within = level.workers_per_unit if first else 1
        input_bytes = row.input_bytes
        low = max(at_least, 2)
        # The root loses up to sqrt(machine epsilon) relative near a double root: trust it
        # only 1e-6 away from a whole number (or the cap), else settle with exact times.
        cap = max_replicas * (1 + 1e-6)
        out = []
        for one, compute, parameters, output_bytes, last, a, b, transfer in entries:
            if at_least == 1 and one <= limit:
                out.append(1)
                continue
            if limit <= 0:  # only a stage that costs nothing at all fits
                zero = _time(
                    compute, parameters, input_bytes, output_bytes, first, last, low,
                    bandwidth, within,
                )
                out.append(low if zero <= limit else 0)
                continue
            # Replicas >= 2: the time only falls as r grows, and is at most T from
            # max(root of T r^2 - (C + a) r + a, transfer / T) on (a = 4P / (B w)).
            disc = b * b - 4 * a * limit
            bound = (b + math.sqrt(disc)) / (2 * limit) if disc > 0 else 0.0
            if transfer > bound * limit:
                bound = transfer / limit
            if bound > cap:
                out.append(0)
                continue
            r = math.ceil(bound) if bound > low else low
            gap = r - bound
            if r > max_replicas or gap < 1e-6 * r or (r > low and gap > 1 - 1e-6 * r):
                # near a whole number: settle with the exact times
                stage = (compute, parameters, input_bytes, output_bytes, first, last)
                r = max(low, min(r, max_replicas + 1) - 1)
                while r <= max_replicas and _time(*stage, r, bandwidth, within) > limit:
                    r += 1
                while r > low and _time(*stage, r - 1, bandwidth, within) <= limit:
                    r -= 1
            out.append(r if r <= max_replicas else 0)
        return out


def _prepare(row: StageRow, level: LevelContext) -> _Prepared:
    """Per entry, in columns: the time on one replica, ``a = 4P / (B w)``, ``b = C + a``,
    and the transfer time on one replica (the input, and the output of a middle stage)."""
    key = ("pipedream", level.bandwidth, level.workers_per_unit)
    cached = row.cache.get(key)
    if cached is None:
        bandwidth, first = level.bandwidth, row.is_first
        within = level.workers_per_unit if first else 1
        transfer_in = 0.0 if first else (2.0 * row.input_bytes) / bandwidth
        if first:
            transfers = array("d", bytes(8 * len(row)))
        else:  # (2 O) / (B * 1), as _time computes it for one replica
            transfers = array("d", [
                transfer_in if last else max(transfer_in, (2.0 * out) / bandwidth)
                for out, last in zip(row.output_bytes, row.is_last)
            ])
        scale = 4 / (bandwidth * within)
        alls = array("d", [scale * p for p in row.parameter_bytes])
        # one replica: no all-reduce, (C + 0) / 1 == C exactly; then max with the transfers
        cached = _Prepared(
            one=array("d", map(max, row.compute_s, transfers)),
            a=alls,
            b=array("d", map(operator.add, row.compute_s, alls)),
            transfer=transfers,
        )
        row.cache[key] = cached
    assert isinstance(cached, _Prepared)
    return cached


@dataclass(frozen=True)
class _Prepared:
    one: array[float]
    a: array[float]
    b: array[float]
    transfer: array[float]


def _held(row: StageRow) -> list[float]:
    """Per entry, the bytes held per minibatch in flight: activations and parameters."""
    cached = row.cache.get("pipedream held")
    if cached is None:
        cached = [a + p for a, p in zip(row.activation_bytes, row.parameter_bytes)]
        row.cache["pipedream held"] = cached
    return cached  # type: ignore[return-value]
