"""Plan files: the stages, replicas and predictions a planner chose, as JSON.

``pipetrain plan --out plan.json`` writes one; ``pipetrain train --plan plan.json`` and
the Python API read it. The JSON form (:meth:`Plan.to_dict`)::

    {"format": "pipetrain-plan", "version": 1,
     "cost_model": "pipedream",
     "time_per_step": 0.2055,            # seconds, predicted by the cost model
     "stages": [                          # pipeline order
        {"nodes": ["node2", ...],         # node ids as in the profile (layer indices, ints,
                                          # for a layer sequence)
         "replicas": 3,                   # workers running the stage (data parallel)
         "time": 0.171,                   # the stage's predicted time per step (s)
         "memory_per_worker": 4.1e9,      # bytes, by the cost model's memory estimate
         "replicas_per_level": [3],       # innermost first; their product is "replicas"
         "outer_stage": []},              # for several levels: the stage's index at each
        ...],                             # outer level (which server group runs it)
     "num_workers": 4, "workers_used": 4,
     "topology": {"levels": [{"num_workers": 4, "bandwidth": 1e9}]},
     "straight": false, "fewer_workers": false, "memory_limit": null,
     "single_worker_time": 0.6725, "data_parallel_time": 0.5832,
     "profile": {"source": "pipedream graph.txt", "path": "...", "num_nodes": 40,
                 "is_sequence": false, "batch_size": 1, "digest": "sha256:..."},
     "schedule": null, "num_microbatches": null, "checkpoint": null,
     "data_parallel": null, "reshard_after_forward": false,
     "reduce_each_microbatch": false, "replicated_memory": null}

``schedule``, ``num_microbatches``, ``checkpoint`` and ``data_parallel`` are filled by
cost models that choose them (the ``pipetrain`` model); ``null`` leaves the choice to the
trainer. ``data_parallel: "fsdp"`` shards each stage's weights over its replicas (every
stage has the same number), ``reshard_after_forward`` and ``reduce_each_microbatch`` are
its options (``pipetrain train --fsdp-reshard`` / ``--fsdp-reduce-each-microbatch``), and
``replicated_memory`` says what the plan would need per worker with whole copies instead.
``num_microbatches`` counts micro-batches per replica of the first stage, as
:class:`~pipetrain.api.config.PipelineConfig` does: a step runs ``num_microbatches x
stages[0].replicas`` of them, dealt round-robin over each stage's replicas.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from pipetrain.plan.profile import Profile

__all__ = ["PLAN_FORMAT", "Plan", "PlanStage", "profile_identity"]

PLAN_FORMAT = "pipetrain-plan"
_VERSION = 1

NodeId = str | int


@dataclass(frozen=True, kw_only=True)
class PlanStage:
    """One stage of a plan: its nodes and how many workers run it.

    Example:
        >>> PlanStage(nodes=(0, 1), replicas=2).replicas_per_level
        (2,)
    """

    nodes: tuple[NodeId, ...]
    """Node ids as in the profile: names for a graph, layer indices for a sequence."""
    replicas: int
    time: float | None = None
    """Predicted seconds per step of the stage."""
    memory_per_worker: float | None = None
    """Predicted bytes per worker."""
    replicas_per_level: tuple[int, ...] = ()
    """Replicas at each topology level, innermost first (empty: ``(replicas,)``)."""
    outer_stage: tuple[int, ...] = ()
    """With several levels: the index of the enclosing stage at each outer level."""

    def __post_init__(self) -> None:
        problems = []
        if not self.nodes:
            problems.append("a stage needs at least one node")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            problems.append(f"replicas={self.replicas!r} must be a whole number >= 1")
        per_level = tuple(self.replicas_per_level) or (self.replicas,)
        if not problems and math.prod(per_level) != self.replicas:
            problems.append(
                f"replicas_per_level={list(per_level)} multiply to {math.prod(per_level)}, "
                f"not replicas={self.replicas}"
            )
        if problems:
            raise ValueError("invalid plan stage: " + "; ".join(problems))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "replicas_per_level", per_level)
        object.__setattr__(self, "outer_stage", tuple(self.outer_stage))

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": list(self.nodes),
            "replicas": self.replicas,
            "time": self.time,
            "memory_per_worker": self.memory_per_worker,
            "replicas_per_level": list(self.replicas_per_level),
            "outer_stage": list(self.outer_stage),
        }

    @staticmethod
    def from_dict(data: dict[str, Any], index: int = 0) -> PlanStage:
        if not isinstance(data, dict) or "nodes" not in data or "replicas" not in data:
            raise ValueError(f"plan stage {index}: needs 'nodes' and 'replicas', got {data!r}")
        try:
            return PlanStage(
                nodes=tuple(data["nodes"]),
                replicas=data["replicas"],
                time=data.get("time"),
                memory_per_worker=data.get("memory_per_worker"),
                replicas_per_level=tuple(data.get("replicas_per_level") or ()),
                outer_stage=tuple(data.get("outer_stage") or ()),
            )
        except ValueError as error:
            raise ValueError(f"plan stage {index}: {error}") from None


def profile_identity(profile: Profile) -> dict[str, Any]:
    """What a plan records about the profile it was made from (a digest of its JSON).

    Example:
        >>> from pipetrain.plan.profile import LayerProfile
        >>> one = Profile(layers=(LayerProfile(name="0", forward_s=1.0, backward_s=0.0),))
        >>> profile_identity(one)["num_nodes"], profile_identity(one)["digest"][:7]
        (1, 'sha256:')
    """
    digest = hashlib.sha256(profile.to_json().encode()).hexdigest()
    return {
        "source": profile.source,
        "path": str(profile.metadata.get("path", "")),
        "num_nodes": profile.num_layers,
        "is_sequence": profile.is_sequence,
        "batch_size": profile.batch_size,
        "digest": f"sha256:{digest}",
        **({"model": dict(profile.model)} if profile.model else {}),
    }


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A pipeline plan: stages in pipeline order with their replicas, and predictions.

    Example:
        >>> plan = Plan(stages=(PlanStage(nodes=(0, 1), replicas=2),
        ...                     PlanStage(nodes=(2,), replicas=1)),
        ...             cost_model="pipedream", time_per_step=0.5, num_workers=3)
        >>> plan.workers_used, plan.num_stages, Plan.from_json(plan.to_json()) == plan
        (3, 2, True)
    """

    stages: tuple[PlanStage, ...]
    cost_model: str
    time_per_step: float
    """Predicted seconds per step (per minibatch), by ``cost_model``."""
    num_workers: int
    """Workers the plan was made for (it may use fewer, see ``workers_used``)."""
    topology: dict[str, Any] = field(default_factory=dict)
    straight: bool = False
    fewer_workers: bool = False
    memory_limit: float | None = None
    single_worker_time: float | None = None
    """Predicted seconds per step on one worker."""
    data_parallel_time: float | None = None
    """Predicted seconds per step of pure data parallelism on all the workers."""
    profile: dict[str, Any] = field(default_factory=dict)
    """The profile's identity (:func:`profile_identity`)."""
    schedule: str | None = None
    num_microbatches: int | None = None
    checkpoint: str | None = None
    data_parallel: str | None = None
    """``fsdp``: the replicas of every stage shard its weights (``pipetrain train
    --fsdp``); ``replicate`` or None: each holds a whole copy."""
    reshard_after_forward: bool = False
    """FSDP: gather the parameters for every forward and backward (``--fsdp-reshard``)."""
    reduce_each_microbatch: bool = False
    """FSDP: reduce-scatter the gradients after every backward
    (``--fsdp-reduce-each-microbatch``)."""
    replicated_memory: float | None = None
    """For an FSDP plan: the most memory per worker the same plan needs replicated."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError("a plan needs at least one stage")
        if self.workers_used > self.num_workers:
            raise ValueError(
                f"the plan's stages use {self.workers_used} workers but num_workers is "
                f"{self.num_workers}"
            )

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def workers_used(self) -> int:
        return sum(stage.replicas for stage in self.stages)

    def speedup_over_one_worker(self) -> float | None:
        if self.single_worker_time is None or self.time_per_step <= 0:
            return None
        return self.single_worker_time / self.time_per_step

    def speedup_over_data_parallel(self) -> float | None:
        if self.data_parallel_time is None or self.time_per_step <= 0:
            return None
        return self.data_parallel_time / self.time_per_step

    def check(self, profile: Profile) -> None:
        """Raise ValueError unless the plan partitions ``profile``'s nodes into stages
        whose edges all point forward (or stay inside a stage)."""
        ids: list[NodeId] = (
            list(range(profile.num_layers))
            if profile.is_sequence
            else [layer.name for layer in profile.layers]
        )
        where: dict[NodeId, int] = {}
        for j, stage in enumerate(self.stages):
            for node in stage.nodes:
                if node not in ids:
                    raise ValueError(f"stage {j} names node {node!r}, which the profile lacks")
                if node in where:
                    raise ValueError(f"node {node!r} is in stages {where[node]} and {j}")
                where[node] = j
        missing = [node for node in ids if node not in where]
        if missing:
            raise ValueError(f"nodes {missing[:10]} are in no stage")
        for a, targets in enumerate(profile.successors()):
            for b in targets:
                if where[ids[a]] > where[ids[b]]:
                    raise ValueError(
                        f"edge {ids[a]!r} -> {ids[b]!r} points from stage {where[ids[a]]} "
                        f"back to stage {where[ids[b]]}"
                    )

    def layer_indices(self, profile: Profile) -> list[list[int]]:
        """Each stage's nodes as layer indices of ``profile`` (ascending)."""
        position: dict[NodeId, int] = {layer.name: k for k, layer in enumerate(profile.layers)}
        if profile.is_sequence:
            position = {k: k for k in range(profile.num_layers)}
        return [sorted(position[node] for node in stage.nodes) for stage in self.stages]

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": _VERSION,
            "cost_model": self.cost_model,
            "time_per_step": self.time_per_step,
            "stages": [stage.to_dict() for stage in self.stages],
            "num_workers": self.num_workers,
            "workers_used": self.workers_used,
            "topology": self.topology,
            "straight": self.straight,
            "fewer_workers": self.fewer_workers,
            "memory_limit": self.memory_limit,
            "single_worker_time": self.single_worker_time,
            "data_parallel_time": self.data_parallel_time,
            "profile": self.profile,
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "checkpoint": self.checkpoint,
            "data_parallel": self.data_parallel,
            "reshard_after_forward": self.reshard_after_forward,
            "reduce_each_microbatch": self.reduce_each_microbatch,
            "replicated_memory": self.replicated_memory,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Plan:
        """Read the JSON form; errors name the missing or bad field."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"not a pipetrain plan (format {got!r}, expected {PLAN_FORMAT!r}); "
                f"write one with 'pipetrain plan --out plan.json'"
            )
        missing = [k for k in ("stages", "cost_model", "time_per_step", "num_workers") if k not in data]
        if missing:
            raise ValueError(f"plan: missing field(s) {missing}")
        stages = data["stages"]
        if not isinstance(stages, list):
            raise ValueError(f"plan: 'stages' must be a list, got {stages!r}")
        return Plan(
            stages=tuple(PlanStage.from_dict(s, k) for k, s in enumerate(stages)),
            cost_model=data["cost_model"],
            time_per_step=data["time_per_step"],
            num_workers=data["num_workers"],
            topology=data.get("topology") or {},
            straight=bool(data.get("straight", False)),
            fewer_workers=bool(data.get("fewer_workers", False)),
            memory_limit=data.get("memory_limit"),
            single_worker_time=data.get("single_worker_time"),
            data_parallel_time=data.get("data_parallel_time"),
            profile=data.get("profile") or {},
            schedule=data.get("schedule"),
            num_microbatches=data.get("num_microbatches"),
            checkpoint=data.get("checkpoint"),
            data_parallel=data.get("data_parallel"),
            reshard_after_forward=bool(data.get("reshard_after_forward", False)),
            reduce_each_microbatch=bool(data.get("reduce_each_microbatch", False)),
            replicated_memory=data.get("replicated_memory"),
        )

    @staticmethod
    def from_json(text: str) -> Plan:
        return Plan.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as file:
            file.write(self.to_json() + "\n")

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Plan:
        """Read a plan written by :meth:`save`."""
        with open(path, encoding="utf-8") as file:
            return Plan.from_json(file.read())
