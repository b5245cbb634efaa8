"""pipetrain's cost model: a stage's time and memory under one schedule, micro-batch count
and checkpoint mode.

A :class:`Candidate` fixes what the pipeline runs: a schedule, ``N`` micro-batches per
step (all replicas together; each stage deals them round-robin over its replicas) and a
checkpoint mode. :class:`PipetrainCostModel` reads a stage's load *per micro-batch* (the
planner gives it a profile scaled to one micro-batch,
:func:`~pipetrain.plan.microbatch_profile.microbatch_profile`) and answers the planner's
questions (:mod:`pipetrain.plan.costs`) for that candidate. Replica ``k`` of a stage on
``r`` replicas runs at most ``n = ceil(N / r)`` micro-batches; a stage with more replicas
than micro-batches, or a first stage whose replicas do not divide ``N`` (the pipeline
takes ``N / r_0`` micro-batches per replica of its first stage), cannot run
(:data:`UNRUNNABLE_TIME`, :data:`UNRUNNABLE_BYTES`).

Time (seconds per step, the busiest replica): the larger of

- compute: ``n (F + B) + R + S + 2 (r - 1) / r * G / bandwidth``, with ``F``, ``B`` a
  micro-batch's forward and backward (for a schedule that splits the backward, as ZB-H1
  does, its two halves ``I + W``; :func:`splits_backward`), ``R`` the recomputed forwards (``n F`` with
  checkpoint ``always``, ``(n - 1) F`` with ``except_last``), ``S`` the optimizer step and
  the ring all-reduce of the gradients ``G`` of a replicated stage;
- its links: ``n (I + O) / bandwidth`` (its input and output activations, forward, and
  their gradients, backward, each way).

Memory (bytes per worker): parameters, gradients and optimizer state; the extra weight
versions of the asynchronous schedules (``pipedream``: one per micro-batch in flight
beyond the first, as its weight stashing keeps; ``2bw``: one); and the activations of the
micro-batches in flight, ``k`` of them: ``gpipe`` all ``n``; ``1f1b``, ``pipedream`` and
``2bw`` ``min(ceil(w / r), n)`` on a stage with ``w`` workers from it to the end (1F1B's
``min(K - j, M)`` on stage ``j`` of a straight pipeline); ``zb-h1`` ``min(ceil(W / r), n)``
for ``W`` workers in all (every stage as its first: the paper's ``min(K, M)`` from ``F``
to ``W``); ``zb-h2`` ``min(ceil((2W - 1) / r), n)`` (its larger budget, the paper's
``2K - 1``). A micro-batch keeps its input and the stage's saved activations, or only its
input when re-materialized (:func:`activation_bytes`); while a backward runs, the stage
also needs its temporary memory (the profile's largest ``backward_workspace_bytes`` of the
stage, or ``backward_input_workspace_bytes`` where the schedule splits the backward).

Example:
    >>> from pipetrain.plan.costs import LevelContext, StageLoad
    >>> load = StageLoad(compute_s=0.3, forward_s=0.1, parameter_bytes=0.0,
    ...                  activation_bytes=0.0, input_bytes=0.0, output_bytes=0.0,
    ...                  is_first=True, is_last=True, saved_bytes=100.0)
    >>> model = PipetrainCostModel(Candidate(schedule="gpipe", num_microbatches=4))
    >>> round(model.stage_time(load, replicas=1, level=LevelContext(bandwidth=1e9)), 6)
    1.2
    >>> model.stage_memory(load, replicas=2, workers_from_stage=2)  # 2 micro-batches each
    200.0
    >>> from dataclasses import replace  # and a backward's temporaries while it runs
    >>> model.stage_memory(replace(load, workspace_bytes=30.0), replicas=2, workers_from_stage=2)
    230.0
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.plan.checkpoint_costs import (
    CHECKPOINT_MODES,
    PER_STAGE,
    PLANNED_CHECKPOINTS,
    SEARCHED_CHECKPOINTS,
    activation_bytes,
    layer_inputs,
    recomputed_forwards,
)
from pipetrain.plan.costs import (
    LevelContext,
    StageLoad,
    StageRow,
    scan_memory_replicas,
    scan_min_replicas,
)
from pipetrain.plan.held_weights import FSDP_POLICIES, weight_versions, weights_held
from pipetrain.schedule import Op, build_schedule

__all__ = [
    "CHECKPOINT_MODES",
    "DATA_PARALLEL_MODES",
    "FSDP_POLICIES",
    "PER_STAGE",
    "PLANNED_CHECKPOINTS",
    "SEARCHED_CHECKPOINTS",
    "UNRUNNABLE_BYTES",
    "UNRUNNABLE_TIME",
    "Candidate",
    "PipetrainCostModel",
    "ReplicaGroups",
    "activation_bytes",
    "in_flight",
    "layer_inputs",
    "recomputed_forwards",
    "splits_backward",
    "stage_mode",
    "weight_versions",
    "weights_held",
]

DATA_PARALLEL_MODES = ("replicate", "fsdp")
"""How the replicas of a stage hold its weights (:attr:`Candidate.data_parallel`)."""
UNRUNNABLE_TIME = 1e18
"""The time of a stage the runtime cannot run (more replicas than micro-batches...)."""
UNRUNNABLE_BYTES = 1e30
"""Its memory: more than any limit."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """What the pipeline runs: a schedule, micro-batches per step, a checkpoint mode.

    Example:
        >>> Candidate(schedule="gpipe", num_microbatches=8, checkpoint="always").checkpoint
        'always'
    """

    schedule: str = "1f1b"
    """A canonical schedule name (:data:`pipetrain.schedule.TRAINING_SCHEDULES`), or
    ``pipedream`` / ``2bw`` for their memory."""
    num_microbatches: int = 1
    """``N``: micro-batches per step, all replicas together."""
    checkpoint: str = "never"
    """One of :data:`PLANNED_CHECKPOINTS`."""
    stage_checkpoints: tuple[str, ...] | None = None
    """Each stage's own mode (``per-stage`` resolved for a plan), overriding
    :attr:`checkpoint` stage by stage."""
    per_replica: tuple[int, ...] | None = None
    """The micro-batches a replica of the first stage may get, ``N`` over its replicas
    (None: any whole share of ``N``): the counts a user asked for, as
    :class:`~pipetrain.api.config.PipelineConfig` counts them."""
    data_parallel: str = "replicate"
    """How a stage's replicas hold its weights: each a whole copy (``replicate``), or
    sharded by FSDP (``fsdp``: see :meth:`PipetrainCostModel.stage_memory`)."""
    reshard_after_forward: bool = False
    """``fsdp``: every forward and backward gathers the stage's parameters and frees them
    after (none kept gathered across the step; one gather per pass)."""
    reduce_each_microbatch: bool = False
    """``fsdp``: every backward reduce-scatters its gradients (no whole gradient kept;
    one reduce-scatter per micro-batch)."""

    @property
    def fsdp_policy(self) -> str:
        """The :data:`FSDP_POLICIES` name of the two options."""
        options = (self.reshard_after_forward, self.reduce_each_microbatch)
        return next(name for name, value in FSDP_POLICIES.items() if value == options)

    def __post_init__(self) -> None:
        n = self.num_microbatches
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_microbatches={n!r} must be a whole number >= 1, e.g. 8")
        if self.checkpoint not in PLANNED_CHECKPOINTS:
            raise ValueError(
                f"checkpoint={self.checkpoint!r} must be one of {', '.join(PLANNED_CHECKPOINTS)}"
            )
        if self.data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(f"data_parallel={self.data_parallel!r} must be one of "
                             f"{', '.join(DATA_PARALLEL_MODES)}")
        if self.data_parallel != "fsdp" and (self.reshard_after_forward
                                             or self.reduce_each_microbatch):
            raise ValueError("reshard_after_forward and reduce_each_microbatch are FSDP "
                             f"options; data_parallel={self.data_parallel!r} has none: fix: "
                             "data_parallel='fsdp'")


def stage_mode(candidate: Candidate, stage: int) -> str:
    """The re-materialization mode of stage ``stage`` under ``candidate``.

    Example:
        >>> c = Candidate(checkpoint="per-stage", stage_checkpoints=("always", "never"))
        >>> stage_mode(c, 0), stage_mode(c, 1), stage_mode(Candidate(), 1)
        ('always', 'never', 'never')
    """
    if candidate.stage_checkpoints is not None:
        return candidate.stage_checkpoints[stage]
    return candidate.checkpoint


def in_flight(schedule: str, *, per_replica: int, replicas: int, workers_from_stage: int,
              num_workers: int) -> int:
    """Micro-batches whose activations a replica keeps at once (see the module docstring).

    Example:
        >>> [in_flight(s, per_replica=8, replicas=1, workers_from_stage=2, num_workers=4)
        ...  for s in ("gpipe", "1f1b", "zb-h1", "pipedream")]
        [8, 2, 4, 2]
    """
    n, r = per_replica, replicas
    if schedule in ("1f1b", "pipedream", "2bw"):
        return min(-(-workers_from_stage // r), n)
    if schedule == "zb-h1":
        return min(-(-num_workers // r), n)
    if schedule == "zb-h2":  # the larger budget: 2K - 1 in flight
        return min(-(-(2 * num_workers - 1) // r), n)
    return n  # gpipe, and any other schedule: every micro-batch (an upper bound)


@functools.cache
def splits_backward(schedule: str) -> bool:
    """Whether the schedule runs a backward as two actions, input then weight gradients
    (``I`` and ``W``); False for a name the schedule registry does not know.

    Example:
        >>> splits_backward("zb-h1"), splits_backward("1f1b"), splits_backward("2bw")
        (True, False, False)
    """
    try:
        built = build_schedule(schedule, num_ranks=2, num_microbatches=2, communication=False)
    except ValueError:
        return False
    return any(a.op is Op.BACKWARD_INPUT for actions in built.actions for a in actions)


class PipetrainCostModel:
    """pipetrain's cost model for one :class:`Candidate` (see the module docstring).

    ``num_workers`` is the cluster's (ZB-H1's activations depend on the pipeline's depth).
    The planner (:mod:`pipetrain.plan.schedule_choice`) makes one per candidate and
    re-scores the plans it finds by simulating them.

    Example:
        >>> from pipetrain.plan.costs import LevelContext, StageLoad, StageRow
        >>> load = StageLoad(compute_s=1.0, parameter_bytes=0.0, activation_bytes=0.0,
        ...                  input_bytes=0.0, output_bytes=0.0, is_first=True, is_last=True)
        >>> model = PipetrainCostModel(Candidate(num_microbatches=6))
        >>> model.min_replicas(StageRow.of([load]), level=LevelContext(bandwidth=1e9),
        ...                    time_limit=2.0, max_replicas=8)  # 3 on 3 replicas each: 3 s
        [3]
    """

    name = "pipetrain"
    replicas_monotone = False
    """More replicas can make a stage slower (the all-reduce grows with them) or unable
    to run (a first stage's replicas must divide the micro-batches)."""

    def __init__(self, candidate: Candidate | None = None, *, num_workers: int = 1) -> None:
        self.candidate = candidate if candidate is not None else Candidate()
        self.num_workers = num_workers

    @property
    def max_replicas(self) -> int:
        """A stage runs on at most as many replicas as there are micro-batches."""
        return self.candidate.num_microbatches

    def runs(self, load: StageLoad, replicas: int) -> bool:
        """Whether the runtime can run the stage on ``replicas`` replicas (a first stage:
        on replicas that share the micro-batches evenly, as many each as allowed)."""
        n = self.candidate.num_microbatches
        return replicas <= n and not (load.is_first and not self.first_runs(replicas))

    def first_runs(self, replicas: int) -> bool:
        """Whether the first stage can run on ``replicas`` replicas: each gets the same
        number of micro-batches, one of :attr:`Candidate.per_replica` when it is given.

        Example:
            >>> model = PipetrainCostModel(Candidate(num_microbatches=8, per_replica=(4,)))
            >>> [r for r in range(1, 9) if model.first_runs(r)]
            [2]
        """
        n, allowed = self.candidate.num_microbatches, self.candidate.per_replica
        return n % replicas == 0 and (allowed is None or n // replicas in allowed)

    def stage_time(self, load: StageLoad, *, replicas: int, level: LevelContext) -> float:
        if not self.runs(load, replicas):
            return UNRUNNABLE_TIME
        c, r = self.candidate, replicas
        n = -(-c.num_microbatches // r)
        recompute = recomputed_forwards(c.checkpoint, n) * load.forward_s
        ring = (r - 1) / r / level.bandwidth
        allreduce = 2 * ring * load.gradient_bytes
        if c.data_parallel == "fsdp":  # a gather per pass, a reduce-scatter per backward
            allreduce += ring * ((2 * n - 1) * load.parameter_bytes * c.reshard_after_forward
                                 + (n - 1) * load.gradient_bytes * c.reduce_each_microbatch)
        passes = load.compute_s
        if splits_backward(c.schedule):
            passes = load.forward_s + load.backward_input_s + load.backward_weight_s
        compute = n * passes + recompute + load.optimizer_step_s + allreduce
        links = n * (load.input_bytes + load.output_bytes) / level.bandwidth
        return max(compute, links)

    def stage_memory(self, load: StageLoad, *, replicas: int, workers_from_stage: int) -> float:
        if not self.runs(load, replicas):
            return UNRUNNABLE_BYTES
        c = self.candidate
        n = -(-c.num_microbatches // replicas)
        kept = in_flight(c.schedule, per_replica=n, replicas=replicas,
                         workers_from_stage=workers_from_stage, num_workers=self.num_workers)
        activations = activation_bytes(
            c.schedule, c.checkpoint, kept=kept, saved_bytes=load.saved_bytes,
            input_bytes=load.input_bytes, layer_input_bytes=layer_inputs(load),
            layer_saved_bytes=load.layer_saved_bytes or None)
        if kept > 0:
            activations += (load.input_workspace_bytes if splits_backward(c.schedule)
                            else load.workspace_bytes)
        versions = weight_versions(c.schedule, kept) * load.parameter_bytes
        return weights_held(load, replicas, c.data_parallel,
                            reshard_after_forward=c.reshard_after_forward,
                            reduce_each_microbatch=c.reduce_each_microbatch
                            ) + versions + activations

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
        # Replica counts with the same n = ceil(N / r) differ only by the all-reduce, which
        # grows with r: the smallest of each such run is the only one worth trying.
        n_total = self.candidate.num_microbatches
        top = min(max_replicas, n_total)
        tried = sorted({max(at_least, -(-n_total // q)) for q in range(1, n_total + 1)})
        tried = [r for r in tried if r <= top]
        if row.is_first:
            tried = [r for r in tried if self.first_runs(r)]
        out = []
        for k in range(len(row)) if indices is None else indices:
            load = row.load(k)
            out.append(next((r for r in tried
                             if self.stage_time(load, replicas=r, level=level) <= time_limit), 0))
        return out

    def memory_replicas(
        self,
        row: StageRow,
        *,
        memory_limit: float,
        workers_after: Sequence[int],
        max_replicas: int,
        indices: Sequence[int] | None = None,
    ) -> list[int]:
        return scan_memory_replicas(self, row, memory_limit=memory_limit,
                                    workers_after=workers_after, max_replicas=max_replicas,
                                    indices=indices)


class ReplicaGroups:
    """A cost model seen in groups of ``size`` replicas: a stage on ``r`` groups is a stage
    on ``r * size`` replicas. A straight search over ``W / size`` groups finds the plans
    whose every stage has ``size`` replicas (the layouts a schedule that needs the same
    replica count everywhere can run).

    Example:
        >>> from pipetrain.plan.costs import LevelContext, StageLoad
        >>> load = StageLoad(compute_s=1.0, parameter_bytes=0.0, activation_bytes=0.0,
        ...                  input_bytes=0.0, output_bytes=0.0, is_first=True, is_last=True)
        >>> model = PipetrainCostModel(Candidate(num_microbatches=4))
        >>> ReplicaGroups(model, 2).stage_time(load, replicas=1, level=LevelContext(bandwidth=1e9))
        2.0
    """

    replicas_monotone = False

    def __init__(self, model: PipetrainCostModel, size: int) -> None:
        self.model, self.size = model, size

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def max_replicas(self) -> int:
        """The most groups a stage runs on (0: a group has more replicas than the
        micro-batches)."""
        return self.model.max_replicas // self.size

    def stage_time(self, load: StageLoad, *, replicas: int, level: LevelContext) -> float:
        return self.model.stage_time(load, replicas=replicas * self.size, level=level)

    def stage_memory(self, load: StageLoad, *, replicas: int, workers_from_stage: int) -> float:
        return self.model.stage_memory(load, replicas=replicas * self.size,
                                       workers_from_stage=workers_from_stage * self.size)

    def min_replicas(self, row: StageRow, *, level: LevelContext, time_limit: float,
                     max_replicas: int, at_least: int = 1,
                     indices: Sequence[int] | None = None) -> list[int]:
        return scan_min_replicas(self, row, level=level, time_limit=time_limit,
                                 max_replicas=max_replicas, at_least=at_least, indices=indices)

    def memory_replicas(self, row: StageRow, *, memory_limit: float,
                        workers_after: Sequence[int], max_replicas: int,
                        indices: Sequence[int] | None = None) -> list[int]:
        return scan_memory_replicas(self, row, memory_limit=memory_limit,
                                    workers_after=workers_after, max_replicas=max_replicas,
                                    indices=indices)
