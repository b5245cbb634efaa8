"""``PipelineConfig``: how a multi-process pipeline is laid out and scheduled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipetrain.checkpoint import CHECKPOINT_MODES
from pipetrain.schedule import SCHEDULE_NAMES, canonical_name

__all__ = ["PipelineConfig"]


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
    """``gpipe``, ``1f1b``, ``interleaved-1f1b`` or ``zb-h1``."""
    num_stages: int = 2
    """Pipeline ranks per replica (``K``)."""
    stages_per_rank: int = 1
    """Virtual stages per rank (``V``, interleaved schedules only)."""
    num_microbatches: int = 8
    """Micro-batches per replica and step (``M``); a smaller batch gives fewer."""
    replicas: int = 1
    """Data-parallel replicas of every stage (``D``)."""
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
    fuse_weight_gradients: bool = True
    """Accumulate linear layers' weight gradients in place (one GEMM into ``.grad``)."""
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
    def world_size(self) -> int:
        """Processes the layout needs: ``num_stages * replicas``."""
        return self.num_stages * self.replicas

    def problems(self) -> list[str]:
        """Every problem with the configuration, each with its fix."""
        found: list[str] = []
        try:
            name = canonical_name(self.schedule)
        except ValueError:
            found.append(
                f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}"
            )
            name = ""
        if name == "forward":
            found.append("schedule 'forward' has no backward; use it through eval_step()")
        for attr in ("num_stages", "stages_per_rank", "num_microbatches", "replicas"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                found.append(f"{attr} must be a positive integer, got {value!r}")
        if name == "interleaved-1f1b" and isinstance(self.stages_per_rank, int) and self.stages_per_rank < 2:
            found.append(
                f"schedule 'interleaved-1f1b' needs stages_per_rank >= 2, got "
                f"{self.stages_per_rank}; fix: stages_per_rank=2"
            )
        if name not in ("interleaved-1f1b", "") and self.stages_per_rank != 1:
            found.append(
                f"stages_per_rank={self.stages_per_rank} needs an interleaved schedule; fix: "
                f"schedule='interleaved-1f1b' or stages_per_rank=1"
            )
        if self.checkpoint not in CHECKPOINT_MODES:
            found.append(
                f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {self.checkpoint!r}"
            )
        if not isinstance(self.deferred_batch_norm, bool):
            found.append(
                f"deferred_batch_norm must be True or False, got {self.deferred_batch_norm!r}; "
                "fix: deferred_batch_norm=True"
            )
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            found.append(f"clip_grad_norm must be positive, got {self.clip_grad_norm!r}")
        if not self.timeout > 0:
            found.append(f"timeout must be positive, got {self.timeout!r}")
        found.extend(self.extra_problems)
        return found
