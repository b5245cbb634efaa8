"""``PipelineConfig``: how a multi-process pipeline is laid out and scheduled."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pipetrain.api.async_config import async_problems
from pipetrain.api.grad_check import NONFINITE_POLICIES
from pipetrain.api.memory_config import memory_problems, stage_budgets
from pipetrain.api.mesh import SPLIT_BACKWARD_SCHEDULES, mesh_problems
from pipetrain.api.step_batches import LOSS_WEIGHTS
from pipetrain.api.user_schedule import (
    is_schedule_file,
    resolve_user_schedule,
    user_schedule_problems,
)
from pipetrain.runtime.precision import LossScaling, precision_problem
from pipetrain.schedule import (
    ASYNC_SCHEDULES,
    TRAINING_SCHEDULES,
    Op,
    Schedule,
    canonical_name,
    schedule_placement,
    stages_per_rank_range,
)
from pipetrain.schedule.memory import stage_modes

__all__ = ["PipelineConfig", "Spelling", "config_problems"]


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The layout and schedule of a :class:`~pipetrain.api.pipeline.Pipeline`.

    The job's ``world_size`` processes form a grid of ``num_stages`` pipeline ranks by
    ``replicas`` data-parallel replicas. With ``stages_per_rank = V > 1`` (interleaved
    and looped schedules) the model is cut into ``num_stages * V`` stages, stage ``j``
    on pipeline rank ``j % num_stages``; the V schedules (``zb-v``, ``dualpipe-v``) put
    stages ``r`` and ``2K-1-r`` on rank ``r`` (:attr:`stage_to_rank`).

    Example:
        >>> PipelineConfig(schedule="interleaved-1f1b", num_stages=2, stages_per_rank=2,
        ...                num_microbatches=4).num_model_stages
        4
        >>> PipelineConfig(schedule="zb-v", num_stages=2, stages_per_rank=2).stage_to_rank
        (0, 1, 1, 0)
    """

    schedule: str | os.PathLike[str] | Schedule = "1f1b"
    """One of :data:`~pipetrain.schedule.TRAINING_SCHEDULES` (``gpipe``, ``1f1b``,
    ``interleaved-1f1b``, ``looped-bfs``, ``zb-h1``, ``zb-h2``, ``zb-v``,
    ``dualpipe-v``, or an alias), an asynchronous one, ``pipedream`` or ``2bw`` (no
    flush; see :mod:`pipetrain.api.async_training`); or a user schedule: a
    :class:`~pipetrain.schedule.Schedule` or the path of a schedule file (see
    :mod:`pipetrain.api.user_schedule`)."""
    num_stages: int = 2
    """Pipeline ranks per replica (``K``)."""
    stages_per_rank: int = 1
    """Stages per rank (``V``): at least 2 for ``interleaved-1f1b`` and
    ``looped-bfs``, exactly 2 for ``zb-v`` and ``dualpipe-v``, else 1."""
    num_microbatches: int = 8
    """Micro-batches per step and per replica of the first stage (``M``; the step runs
    ``M x`` that stage's replicas in all, dealt round-robin); a smaller batch gives fewer."""
    replicas: int = 1
    """Data-parallel replicas of every stage (``D``)."""
    stage_replicas: tuple[int, ...] | None = None
    """Replicas of each pipeline rank, when they differ (a plan's layout, e.g. ``(2, 1)``:
    stage 0 on two processes, stage 1 on one); needs one stage per rank, ``replicas=1``
    and the ``gpipe`` or ``1f1b`` schedule."""
    checkpoint: str | Sequence[str] = "never"
    """What each stage does with its activations: ``always``, ``except_last`` or
    ``never`` (which micro-batches are re-materialized: all, all but the last, none) or
    ``selective`` (keep only the outputs of matrix products and attention, recompute the
    rest: :mod:`pipetrain.runtime.selective`) or ``per_layer`` (re-materialize each layer
    on its own: a micro-batch keeps every layer's input and its backward rebuilds one layer
    at a time, so it holds one layer's activations, not the stage's); one mode for every stage, or one per model
    stage (``num_stages * stages_per_rank`` entries, e.g. ``("always", "selective",
    "never")``, or the same comma-separated). Asynchronous schedules take one of
    ``always`` and ``never``."""
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
    loss_per: str = "sample"
    """How a step's micro-batch losses are weighed: ``sample`` (each micro-batch by its share
    of the batch's samples) or ``token`` (by its share of the batch's real tokens, the
    integer targets that are not ``-100``: the loss of batches padded to different lengths
    is then the mean over their real tokens, as one process's ``cross_entropy`` gives;
    ``loss_fn`` must then be the mean over a micro-batch's real tokens)."""
    fuse_weight_gradients: bool = True
    """Accumulate linear layers' weight gradients in place (one GEMM into ``.grad``)."""
    compile: bool = False
    """Compile each layer of this rank's stages with ``torch.compile`` (``nn.Module.compile``,
    in place: the parameters keep their names), as torchtitan compiles per block. The
    first step compiles (each new micro-batch shape too: the second shape makes dims
    dynamic). Not with schedules that split backwards, asynchronous schedules, FSDP or
    tensor parallelism (not available yet)."""
    offload: float | Sequence[float | None] | None = None
    """MiB of saved activations each stage keeps on its device; what its forwards save
    beyond that goes to host memory until the backward (:mod:`pipetrain.runtime.offload`:
    on a GPU, pinned memory and a side stream, brought back one action ahead; on the CPU
    nothing moves). One budget for every stage (``0``: offload all), or one per model
    stage (``None``: that stage keeps all); ``None``: no offload. Not with asynchronous
    schedules."""
    mixed_precision: str | None = None
    """``"bf16"`` or ``"fp16"``: every stage's forward, recomputation and loss run under
    ``torch.autocast`` with that dtype, parameters and optimizer state stay float32; fp16
    also scales the loss dynamically (:attr:`loss_scaling`), skipping on every stage a
    step whose gradients overflow on any. ``None``: float32. See
    :mod:`pipetrain.runtime.precision`."""
    loss_scaling: LossScaling | None = None
    """The dynamic loss scale's settings with ``mixed_precision="fp16"`` (default:
    ``LossScaling()``, torch.amp.GradScaler's defaults)."""
    exit_when_stuck: float | None = None
    """Seconds after a peer's failure is found after which this process is ended (SIGKILL,
    the failure written to stderr first) if its main thread still has not seen it (it is
    blocked in a call that cannot see it: a collective, a wait on a peer that froze
    without closing its connections). ``None`` (default): such calls end at their own
    timeout (:attr:`timeout`); the process is never ended behind the caller's back."""
    vertical_sync: bool = False
    """``pipedream`` only: every stage runs a micro-batch with the weight version the input
    stage used for it (PipeDream's vertical sync)."""
    data_parallel: str = "replicate"
    """How the ``replicas`` hold a stage: ``replicate`` (every replica a whole copy, the
    gradients all-reduced once per step) or ``fsdp`` (FSDP2's ``fully_shard`` over the
    replicas: parameters, gradients and optimizer state sharded; see
    :mod:`pipetrain.api.fsdp`). The job is one mesh ``(pp, dp, tp)`` (see
    :mod:`pipetrain.api.mesh`)."""
    tensor_parallel: int = 1
    """Tensor-parallel ranks of every (stage, replica) position (``T``, the mesh's
    innermost dimension); with ``T > 1`` the Pipeline needs a ``tensor_parallel_plan``
    (see :mod:`pipetrain.api.tensor_parallel`)."""
    reshard_after_forward: bool = False
    """``fsdp`` only: free the gathered parameters after each forward and gather them again
    for each backward (less memory, one all-gather per micro-batch); default: gathered once
    per step, kept until the step's last backward."""
    reduce_each_microbatch: bool = False
    """``fsdp`` only: reduce-scatter each micro-batch's gradients right after its backward
    and accumulate them sharded (as ZeRO-2 does), so that a stage never holds a whole
    gradient; with ``reshard_after_forward`` the parameters, gradients and optimizer
    state a worker keeps are all sharded. One reduce-scatter per micro-batch instead of
    one per step; a step whose replicas run different numbers of micro-batches (a smaller
    last batch) reduces once instead (each reduce-scatter is a collective of all of
    them)."""
    extra_problems: tuple[str, ...] = field(default=(), repr=False)
    _user_schedule: Schedule | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = list(self.problems())
        if problems:
            raise ValueError("invalid PipelineConfig:\n" + "\n".join(f"  * {p}" for p in problems))
        object.__setattr__(self, "_user_schedule", resolve_user_schedule(self.schedule))
        for name in ("checkpoint", "offload"):  # a list given: kept as a (hashable) tuple
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, int, float)):
                object.__setattr__(self, name, tuple(value))

    @property
    def user_schedule(self) -> Schedule | None:
        """The user schedule, lowered and validated (``None`` for a schedule name)."""
        return self._user_schedule

    @property
    def schedule_name(self) -> str:
        """The schedule's canonical name (a user schedule's own name)."""
        if self._user_schedule is not None:
            return self._user_schedule.name
        assert isinstance(self.schedule, str)
        return canonical_name(self.schedule)

    @property
    def stage_to_rank(self) -> tuple[int, ...]:
        """The pipeline rank of each model stage."""
        if self._user_schedule is not None:
            return self._user_schedule.stage_to_rank
        return schedule_placement(self.schedule_name, self.num_stages, self.stages_per_rank)

    @property
    def checkpoint_modes(self) -> tuple[str, ...]:
        """The re-materialization mode of each model stage (see :attr:`checkpoint`).

        Example:
            >>> PipelineConfig(num_stages=2, checkpoint="selective,never").checkpoint_modes
            ('selective', 'never')
        """
        return stage_modes(self.checkpoint, self.num_model_stages)

    @property
    def offload_bytes(self) -> tuple[int | None, ...]:
        """Per model stage, the bytes of saved activations kept on the device (``None``:
        all of them; see :attr:`offload`).

        Example:
            >>> PipelineConfig(num_stages=2, offload=(None, 0.5)).offload_bytes
            (None, 524288)
        """
        return stage_budgets(self.offload, self.num_model_stages)

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
        """Processes the layout needs: the replicas of every pipeline rank (times
        :attr:`tensor_parallel`)."""
        return sum(self.replica_counts) * self.tensor_parallel

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
        ["stages_per_rank=2 needs an interleaved schedule (several stages per rank: interleaved-1f1b, looped-bfs, zb-v, dualpipe-v); fix: schedule='interleaved-1f1b' or stages_per_rank=1"]
        >>> config_problems({"schedule": "zb-v", "num_stages": 3})
        ["schedule 'zb-v' places exactly 2 stages per rank (a V: rank r holds stages r and 2K-1-r), got stages_per_rank=1; fix: stages_per_rank=2"]
        >>> config_problems({"num_stages": 0}, spell=lambda name, value: f"--{name} {value}")
        ['--num_stages 0 must be a positive integer, e.g. --num_stages 2']
    """
    say = _python_spelling if spell is None else spell
    v: dict[str, Any] = {f.name: f.default for f in fields(PipelineConfig)} | dict(values)
    v["extra_problems"] = tuple(v.get("extra_problems") or ())
    found: list[str] = []
    schedule = v["schedule"]
    is_user = isinstance(schedule, Schedule) or is_schedule_file(schedule)
    user = _user_schedule(v, found) if is_user else None
    try:
        name = canonical_name(schedule) if isinstance(schedule, str) else ""
    except ValueError:
        name = ""
    if not is_user and name not in TRAINING_SCHEDULES:
        choices = ", ".join(TRAINING_SCHEDULES)
        what = (f"schedule {schedule!r} has no backward (eval_step runs it)" if name == "forward"
                else f"unknown schedule {schedule!r} (neither a schedule name nor an existing "
                     f"schedule file)")
        found.append(f"{what}; choose one of {choices}, e.g. {say('schedule', '1f1b')}, or "
                     f"the path of a schedule file")
    if name not in TRAINING_SCHEDULES:
        name = ""
    for attr in ("num_stages", "stages_per_rank", "num_microbatches", "replicas"):
        value = v[attr]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            example = 2 if attr in ("num_stages", "stages_per_rank") else 8 if attr == "num_microbatches" else 1
            found.append(f"{say(attr, value)} must be a positive integer, e.g. {say(attr, example)}")
    if user is not None and all(isinstance(v[a], int) for a in ("num_stages", "stages_per_rank")):
        found.extend(user_schedule_problems(user, v, say))
    if name:
        found.extend(_stages_per_rank_problems(name, v["stages_per_rank"], say))
    stage_replicas = v["stage_replicas"]
    if stage_replicas is not None:
        found.extend(_stage_replica_problems(tuple(stage_replicas), v, name, say))
    found.extend(memory_problems(v, name, say))
    if not isinstance(v["deferred_batch_norm"], bool):
        found.append(f"{say('deferred_batch_norm', v['deferred_batch_norm'])} must be True or "
                     f"False, e.g. {say('deferred_batch_norm', True)}")
    clip = v["clip_grad_norm"]
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0 and math.isfinite(clip)):
        found.append(f"{say('clip_grad_norm', clip)} must be a positive number, e.g. "
                     f"{say('clip_grad_norm', 1.0)}")
    if v["loss_per"] not in LOSS_WEIGHTS:
        found.append(f"{say('loss_per', v['loss_per'])} must be one of {', '.join(LOSS_WEIGHTS)}, "
                     f"e.g. {say('loss_per', 'token')} for batches padded to different lengths")
    if v["nonfinite"] not in NONFINITE_POLICIES:
        found.append(
            f"{say('nonfinite', v['nonfinite'])} must be one of {', '.join(NONFINITE_POLICIES)}"
        )
    problem = precision_problem(v["mixed_precision"], spelled=say("mixed_precision", v["mixed_precision"]))
    if problem is not None:
        found.append(problem)
    scaling = v["loss_scaling"]
    if scaling is not None:
        if not isinstance(scaling, LossScaling):
            found.append(f"{say('loss_scaling', scaling)} must be a LossScaling, e.g. "
                         "loss_scaling=LossScaling(init_scale=1024.0)")
        else:
            found.extend(scaling.problems())
            if v["mixed_precision"] != "fp16":
                found.append(f"loss_scaling is set but {say('mixed_precision', v['mixed_precision'])}"
                             f"; fix: {say('mixed_precision', 'fp16')} (only fp16 scales the loss)")
    stuck = v["exit_when_stuck"]
    if stuck is not None and not (isinstance(stuck, (int, float)) and not isinstance(stuck, bool)
                                  and stuck > 0):
        found.append(f"{say('exit_when_stuck', stuck)} must be a positive number of seconds or "
                     f"None, e.g. {say('exit_when_stuck', 20.0)}")
    timeout = v["timeout"]
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        found.append(f"{say('timeout', timeout)} must be a positive number of seconds, e.g. "
                     f"{say('timeout', 300.0)}")
    found.extend(async_problems(v, name, say))
    found.extend(mesh_problems(v, name, say))
    splits = name in SPLIT_BACKWARD_SCHEDULES or (user is not None and any(
        a.op is Op.BACKWARD_INPUT for rank in user.actions for a in rank))
    if user is not None and v["data_parallel"] == "fsdp" and splits:
        found.append(f"the user schedule {user.name!r} splits backwards into input and weight "
                     "halves (I and W actions), which FSDP cannot run (it reduce-scatters a "
                     "module's gradients from its own hook when the input half passes it, "
                     "before the weight half has computed them); fix: full backwards (B "
                     f"actions), or {say('data_parallel', 'replicate')}")
    found.extend(_compile_problems(v, name, splits, say))
    found.extend(v["extra_problems"])
    return found


def _compile_problems(v: Mapping[str, Any], name: str, splits: bool, say: Spelling) -> list[str]:
    """What ``compile=True`` cannot run with yet: a compiled layer's backward is one graph,
    which a split backward cannot cut into input and weight halves; asynchronous schedules
    swap weight versions under it; FSDP and tensor parallelism change the parameters into
    DTensors after it would compile."""
    if v["compile"] is not True:
        if v["compile"] is not False:
            return [f"{say('compile', v['compile'])} must be True or False"]
        return []
    what = f"schedule {name!r}" if name else "the user schedule"
    unavailable = [f"{what} (it splits backwards)"] if splits else []
    if name in ASYNC_SCHEDULES:
        unavailable.append(f"schedule {name!r}")
    if v["data_parallel"] == "fsdp":
        unavailable.append(say("data_parallel", "fsdp"))
    if v["tensor_parallel"] != 1:
        unavailable.append(say("tensor_parallel", v["tensor_parallel"]))
    if not unavailable:
        return []
    return [f"{say('compile', True)} with {' and '.join(unavailable)} is not available yet; "
            f"fix: {say('compile', False)}, or {say('schedule', '1f1b')} (or gpipe, "
            "interleaved-1f1b, looped-bfs) on replicated stages"]


def _user_schedule(v: Mapping[str, Any], found: list[str]) -> Schedule | None:
    """The user schedule of the values (None for a name, or when it cannot be read:
    then its problem is in ``found``)."""
    try:
        return resolve_user_schedule(v["schedule"])
    except (OSError, ValueError) as error:
        where = ("the schedule" if isinstance(v["schedule"], Schedule)
                 else f"schedule file {os.fspath(v['schedule'])!r}")
        found.append(f"{where}: {error}")
        return None


def _stages_per_rank_problems(name: str, stages_per_rank: Any, say: Spelling) -> list[str]:
    """Whether schedule ``name`` takes ``stages_per_rank`` stages per rank."""
    if not isinstance(stages_per_rank, int) or isinstance(stages_per_rank, bool):
        return []  # reported as not a positive integer
    least, most = stages_per_rank_range(name)
    if least == most == 2 and stages_per_rank != 2:
        return [f"schedule {name!r} places exactly 2 stages per rank (a V: rank r holds "
                f"stages r and 2K-1-r), got {say('stages_per_rank', stages_per_rank)}; fix: "
                f"{say('stages_per_rank', 2)}"]
    if stages_per_rank < least:
        return [f"schedule {name!r} needs at least {least} stages per rank, got "
                f"{say('stages_per_rank', stages_per_rank)}; fix: {say('stages_per_rank', least)}"]
    if most is not None and stages_per_rank > most:
        return [f"{say('stages_per_rank', stages_per_rank)} needs an interleaved schedule "
                f"(several stages per rank: interleaved-1f1b, looped-bfs, zb-v, dualpipe-v); fix: "
                f"{say('schedule', 'interleaved-1f1b')} or {say('stages_per_rank', 1)}"]
    return []
