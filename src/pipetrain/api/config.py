"""``PipelineConfig``: how a multi-process pipeline is laid out and scheduled."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pipetrain.api.async_config import async_problems
from pipetrain.api.grad_check import NONFINITE_POLICIES
from pipetrain.checkpoint import CHECKPOINT_MODES
from pipetrain.schedule import ASYNC_SCHEDULES, TRAINING_SCHEDULES, canonical_name

__all__ = ["PipelineConfig", "Spelling", "config_problems"]


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The layout and schedule of a :class:`~pipetrain.api.pipeline.Pipeline`.

    The job's ``world_size`` processes form a grid of ``num_stages`` pipeline ranks by
    ``replicas`` data-parallel replicas. With ``stages_per_rank = V > 1`` (interleaved
    schedules) the model is cut into ``num_stages * V`` stages, stage ``j`` on pipeline
    rank ``j % num_stages``.

    Example:
        >>> PipelineConfig(schedule="interleaved-1f1b", num_stages=2, stages_per_rank=2,
        ...                num_microbatches=4).num_model_stages
        4
    """

    schedule: str = "1f1b"
    """One of :data:`~pipetrain.schedule.TRAINING_SCHEDULES`: ``gpipe``, ``1f1b``,
    ``interleaved-1f1b`` or ``zb-h1`` (or an alias), or an asynchronous one, ``pipedream``
    or ``2bw`` (no flush; see :mod:`pipetrain.api.async_training`)."""
    num_stages: int = 2
    """Pipeline ranks per replica (``K``)."""
    stages_per_rank: int = 1
    """Virtual stages per rank (``V``, interleaved schedules only)."""
    num_microbatches: int = 8
    """Micro-batches per step and per replica of the first stage (``M``; the step runs
    ``M x`` that stage's replicas in all, dealt round-robin); a smaller batch gives fewer."""
    replicas: int = 1
    """Data-parallel replicas of every stage (``D``)."""
    stage_replicas: tuple[int, ...] | None = None
    """Replicas of each pipeline rank, when they differ (a plan's layout, e.g. ``(2, 1)``:
    stage 0 on two processes, stage 1 on one); needs one stage per rank, ``replicas=1``
    and the ``gpipe`` or ``1f1b`` schedule."""
    checkpoint: str = "never"
    """``always``, ``except_last`` or ``never``: which micro-batches are re-materialized."""
    balance: Sequence[int] | None = None
    """Layers per model stage (``num_stages * stages_per_rank`` entries); default: even."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm (over all stages) to this value."""
    seed: int = 0
    """Seed of the random streams (dropout, any random op): every layer draws from a
    stream keyed by (seed, step, global layer index, micro-batch), whatever the stages."""
    deferred_batch_norm: bool = False
    """Turn the layers' batch norms into :class:`~pipetrain.batchnorm.DeferredBatchNorm`:
    running statistics updated once per step over the whole mini-batch (every
    micro-batch of every replica), as single-process training stores them."""
    timeout: float = 300.0
    """Seconds a rank waits for a message before it reports a stuck peer."""
    heartbeat_timeout: float = 10.0
    """Seconds without a heartbeat after which a peer is declared dead."""
    nonfinite: str = "error"
    """A step whose loss or global gradient norm is not finite: ``error`` applies no
    update and raises :class:`~pipetrain.api.grad_check.NonFiniteError` (the weights
    stay those of the last good step); ``skip`` applies no update and goes on (the step
    counts); ``ignore`` applies it anyway."""
    fuse_weight_gradients: bool = True
    """Accumulate linear layers' weight gradients in place (one GEMM into ``.grad``)."""
    vertical_sync: bool = False
    """``pipedream`` only: every stage runs a micro-batch with the weight version the input
    stage used for it (PipeDream's vertical sync)."""
    extra_problems: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        problems = list(self.problems())
        if problems:
            raise ValueError("invalid PipelineConfig:\n" + "\n".join(f"  * {p}" for p in problems))

    @property
    def num_model_stages(self) -> int:
        """Stages the model is cut into: ``num_stages * stages_per_rank``."""
        return self.num_stages * self.stages_per_rank

    @property
    def replica_counts(self) -> tuple[int, ...]:
        """Replicas of each pipeline rank."""
        if self.stage_replicas is not None:
            return tuple(self.stage_replicas)
        return (self.replicas,) * self.num_stages

    @property
    def total_microbatches(self) -> int:
        """Micro-batches of a full step, all replicas together: ``num_microbatches`` per
        replica of the first stage."""
        return self.num_microbatches * self.replica_counts[0]

    @property
    def world_size(self) -> int:
        """Processes the layout needs: the replicas of every pipeline rank."""
        return sum(self.replica_counts)

    def problems(self, *, spell: Spelling | None = None) -> list[str]:
        """Every problem with the configuration, each with its fix (see
        :func:`config_problems`)."""
        return config_problems(
            {f.name: getattr(self, f.name) for f in fields(self)}, spell=spell
        )


Spelling = Callable[[str, Any], str]
"""How an error message writes a setting: ``spell("stages_per_rank", 2)`` gives
``stages_per_rank=2`` in Python; a command line spells it by its flag (``--virtual 2``)."""


def _python_spelling(name: str, value: Any) -> str:
    return f"{name}={value!r}"


def _stage_replica_problems(counts: tuple[Any, ...], v: Mapping[str, Any], name: str,
                            say: Spelling) -> list[str]:
    from pipetrain.schedule.replicated import REPLICATED_SCHEDULES

    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        return [f"{say('stage_replicas', counts)} must be positive integers, one per pipeline rank"]
    found = []
    if isinstance(v["num_stages"], int) and len(counts) != v["num_stages"]:
        found.append(f"{say('stage_replicas', counts)} has {len(counts)} entries for "
                     f"{say('num_stages', v['num_stages'])}; fix: one count per pipeline rank")
    if v["replicas"] != 1:
        found.append(f"{say('stage_replicas', counts)} and {say('replicas', v['replicas'])} both "
                     "set replicas; fix: keep one of them")
    if len(set(counts)) > 1:
        if v["stages_per_rank"] != 1:
            found.append(f"{say('stage_replicas', counts)} differ between ranks, which needs "
                         f"{say('stages_per_rank', 1)}")
        if name and name not in REPLICATED_SCHEDULES and name not in ASYNC_SCHEDULES:
            found.append(f"{say('stage_replicas', counts)} differ between ranks, which schedule "
                         f"{name!r} cannot run; fix: {say('schedule', '1f1b')} or "
                         f"{say('schedule', 'gpipe')}")
    return found


def config_problems(values: Mapping[str, Any], *, spell: Spelling | None = None) -> list[str]:
    """Every problem with the :class:`PipelineConfig` fields ``values`` (missing fields
    take their defaults), each naming the bad value and a fix written by ``spell``.

    Example:
        >>> config_problems({"schedule": "1f1b", "stages_per_rank": 2})
        ["stages_per_rank=2 needs an interleaved schedule; fix: schedule='interleaved-1f1b' or stages_per_rank=1"]
        >>> config_problems({"num_stages": 0}, spell=lambda name, value: f"--{name} {value}")
        ['--num_stages 0 must be a positive integer, e.g. --num_stages 2']
    """
    say = _python_spelling if spell is None else spell
    v: dict[str, Any] = {f.name: f.default for f in fields(PipelineConfig)} | dict(values)
    v["extra_problems"] = tuple(v.get("extra_problems") or ())
    found: list[str] = []
    try:
        name = canonical_name(v["schedule"])
    except ValueError:
        name = ""
    if name not in TRAINING_SCHEDULES:
        choices = ", ".join(TRAINING_SCHEDULES)
        what = (f"schedule {v['schedule']!r} has no backward (eval_step runs it)"
                if name == "forward" else f"unknown schedule {v['schedule']!r}")
        found.append(f"{what}; choose one of {choices}, e.g. {say('schedule', '1f1b')}")
        name = ""
    for attr in ("num_stages", "stages_per_rank", "num_microbatches", "replicas"):
        value = v[attr]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            example = 2 if attr in ("num_stages", "stages_per_rank") else 8 if attr == "num_microbatches" else 1
            found.append(f"{say(attr, value)} must be a positive integer, e.g. {say(attr, example)}")
    stages_per_rank = v["stages_per_rank"]
    if name == "interleaved-1f1b" and isinstance(stages_per_rank, int) and stages_per_rank < 2:
        found.append(
            f"schedule 'interleaved-1f1b' needs stages_per_rank >= 2, got "
            f"{say('stages_per_rank', stages_per_rank)}; fix: {say('stages_per_rank', 2)}"
        )
    if name not in ("interleaved-1f1b", "") and stages_per_rank != 1:
        found.append(
            f"{say('stages_per_rank', stages_per_rank)} needs an interleaved schedule; fix: "
            f"{say('schedule', 'interleaved-1f1b')} or {say('stages_per_rank', 1)}"
        )
    stage_replicas = v["stage_replicas"]
    if stage_replicas is not None:
        found.extend(_stage_replica_problems(tuple(stage_replicas), v, name, say))
    if v["checkpoint"] not in CHECKPOINT_MODES:
        found.append(
            f"{say('checkpoint', v['checkpoint'])}: the mode must be one of "
            f"{', '.join(CHECKPOINT_MODES)}, e.g. {say('checkpoint', 'never')}"
        )
    if not isinstance(v["deferred_batch_norm"], bool):
        found.append(f"{say('deferred_batch_norm', v['deferred_batch_norm'])} must be True or "
                     f"False, e.g. {say('deferred_batch_norm', True)}")
    clip = v["clip_grad_norm"]
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0 and math.isfinite(clip)):
        found.append(f"{say('clip_grad_norm', clip)} must be a positive number, e.g. "
                     f"{say('clip_grad_norm', 1.0)}")
    if v["nonfinite"] not in NONFINITE_POLICIES:
        found.append(
            f"{say('nonfinite', v['nonfinite'])} must be one of {', '.join(NONFINITE_POLICIES)}"
        )
    timeout = v["timeout"]
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        found.append(f"{say('timeout', timeout)} must be a positive number of seconds, e.g. "
                     f"{say('timeout', 300.0)}")
    found.extend(async_problems(v, name, say))
    found.extend(v["extra_problems"])
    return found
